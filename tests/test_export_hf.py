"""`lm export hf`: transformers loads the folder as Llama with equal logits and equal token ids."""

import itertools
import json
import re
import shutil

import numpy as np
import pytest
import torch
from helpers.run_dir import make_run_dir, save_model

from lm.checkpoint import export_safetensors
from lm.cli import main
from lm.export import export_hf, llama_config, to_llama_state_dict, to_transformers
from lm.model import ModelConfig, Seq2SeqConfig, TransformerLM, build_model

transformers = pytest.importorskip("transformers")

TEXT = "Lily found a red ball in the park. \"Is it yours?\" she asked the dog. Café naïve 123!\n"


# Hugging Face's Llama against lm's model, float32: measured at most 9.5e-7 apart (3 seeds), as
# test_model.py's parity test; a 10x wrong rms_norm_eps moves the logits by 2e-5, which this catches
CLOSE = dict(atol=6e-6, rtol=0)


def _norms_away_from_one(model):
    """Norm weights drawn in [0.5, 1.5], so a misplaced or missing norm weight shows in the logits."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_final.weight":
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d, model, tok = make_run_dir(tmp_path_factory.mktemp("run"), (TEXT + "<|endoftext|>") * 30, 320,
                                 context_length=32, d_model=64, num_layers=2, num_heads=4, d_ff=128)
    _norms_away_from_one(model)
    save_model(d, model)
    return d, model.eval(), tok


@pytest.mark.parametrize("tied", [False, True])
def test_export_loads_as_llama_with_equal_logits(tmp_path, tied):
    torch.manual_seed(1)
    model = _norms_away_from_one(TransformerLM(300, 32, 64, 2, 4, 128, 500.0, tie_embeddings=tied)).eval()
    export_hf(model, tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    # the weights say they are torch's, as save_pretrained writes them: transformers 4 refuses a file whose
    # format it cannot read there (mutation: the key misspelt, survived: the version installed does not look)
    from safetensors import safe_open

    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), **CLOSE)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("reader", ["installed", "4.x"])
def test_to_transformers_rotates_with_the_models_rope_theta(monkeypatch, reader, tied):
    """to_transformers passed θ only as rope_parameters, which transformers 4.x (allowed by the bench
    extra's pins) ignores: it rotated with θ = 10000 and gave other logits, with no error. "4.x" builds
    the config as 4.x reads it (rope_theta, or its default), so this is checked with transformers 5 too."""
    if reader == "4.x":
        llama_config = transformers.LlamaConfig

        def as_4x_reads_it(rope_parameters=None, rope_theta=10000.0, **fields):
            rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}  # what 4.x's LlamaConfig uses
            return llama_config(rope_theta=rope_theta, rope_parameters=rope_parameters, **fields)

        # by name: once a model is built, `import transformers` may give another module object than ours
        monkeypatch.setattr("transformers.LlamaConfig", as_4x_reads_it)
    torch.manual_seed(2)
    model = _norms_away_from_one(TransformerLM(300, 32, 64, 2, 4, 128, 500.0, tie_embeddings=tied)).eval()
    hf = to_transformers(model)
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids), **CLOSE)


def test_config_json_spells_out_what_other_readers_of_llama_configs_need(tmp_path):
    """transformers fills num_key_value_heads (from num_attention_heads) and the rope type ("default")
    when they are missing, so the logits tests cannot see them dropped or misspelt; other readers of a
    Llama config.json (vLLM's, llama.cpp's converter) take them from the file. Written out in full."""
    model = TransformerLM(300, 32, 64, 2, 4, 128, 500.0)
    export_hf(model, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert {k: config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                   "rope_parameters")} == {
        "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16, "rope_theta": 500.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}


def test_cli_export_with_tokenizer(run, tmp_path, capsys):
    d, model, tok = run
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(tmp_path / "hf")]) == 0
    out = tmp_path / "hf"
    # it names the file it exported (a run folder resolves to one of several files)
    assert capsys.readouterr().out.rstrip().endswith(f" from {d / 'model.safetensors'}")
    assert {p.name for p in out.iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                               "tokenizer_config.json", ".lm-output.json"}
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    text = TEXT + "<|endoftext|>" + TEXT.upper()
    ids = tok.encode(text)
    assert hf_tok(text)["input_ids"] == ids
    x = torch.tensor([ids[:32]])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), **CLOSE)
    assert hf.config.eos_token_id == tok.token_to_id[b"<|endoftext|>"]
    # an earlier export is not replaced without --overwrite (the 0.1 positional spelling still works)
    assert main(["export", "hf", str(d), str(out)]) == 2
    err = capsys.readouterr().err
    assert "CHECKPOINT is deprecated" in err and "exists; pass --overwrite to replace it" in err
    # the export given back to lm: said to be what it is, where "it was not written by lm" (ckpt21)
    for command in (["sample", "--prompt", "Once", "--max-new-tokens", "2"],
                    ["export", "hf", "--out", str(tmp_path / "x")]):
        assert main([*command, "--checkpoint", str(out)]) == 2
        assert capsys.readouterr().err.endswith(
            f": error: --checkpoint: {str(out / 'model.safetensors')!r} has no 'model_config' metadata: it is a "
            "Hugging Face model (its config.json is beside it: `lm export hf` writes such folders), which lm does not "
            "load back; pass the lm run folder, its model.safetensors or a checkpoint\n")


def test_an_out_that_holds_the_checkpoint_or_the_tokenizer_names_the_input_in_this_process(run, tmp_path, capsys):
    """`--out` holding an input is refused naming the input as an option (seen before only by a
    process test): the run folder holds --checkpoint, a folder above --tokenizer holds it."""
    d, _, _ = run
    before = {p: p.stat().st_mtime_ns for p in d.rglob("*")}
    assert main(["export", "hf", "--checkpoint", str(d / "model.safetensors"), "--out", str(d), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"lm export hf: error: --out: {str(d)!r} contains the input --checkpoint "
                                       f"{str(d / 'model.safetensors')!r}; choose another output\n")
    tokenizer = tmp_path / "t" / "tok"
    shutil.copytree(d / "tokenizer", tokenizer)
    assert main(["export", "hf", "--checkpoint", str(d), "--tokenizer", str(tokenizer), "--out", str(tmp_path / "t"),
                 "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"lm export hf: error: --out: {str(tmp_path / 't')!r} contains the input "
                                       f"--tokenizer {str(tokenizer)!r}; choose another output\n")
    assert {p: p.stat().st_mtime_ns for p in d.rglob("*")} == before


def test_exported_tokenizer_decodes_as_lm_on_transformers_4(run, tmp_path):
    """tokenizer_config.json left clean_up_tokenization_spaces to transformers' default, True up to
    4.44 (allowed by the bench extra): decode deleted the space before "." or "n't". Written False, the
    folder decodes as lm's tokenizer on every version; with True, 4.44 would decode this text otherwise."""
    import json

    _, model, tok = run
    out = export_hf(model, tmp_path / "hf", tok)
    assert json.loads((out / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False
    text = "a . b , c ? I 'm here , don 't go x n't"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert not hf_tok.clean_up_tokenization_spaces and hf_tok.decode(ids) == text
    # the clean-up that 4.44 applies by default (5.x ignores the flag for BPE tokenizers)
    assert hf_tok.clean_up_tokenization(text) == "a. b, c? I'm here, don 't go xn't"


def test_compiled_models_export_as_the_plain_model(tmp_path):
    """export_hf and to_transformers read the state dict of the model they were given: torch.compile's
    wrapper (and DDP's) prefixes every key, and both raised KeyError 'token_embeddings.weight'.
    They unwrap it as export_safetensors does (compiling is lazy: nothing here runs the model)."""
    torch.manual_seed(3)
    model = TransformerLM(300, 32, 64, 2, 4, 128, 500.0).eval()
    compiled = torch.compile(model)
    export_hf(compiled, tmp_path / "hf")
    ids = torch.randint(0, 300, (2, 32))
    with torch.no_grad():
        expected = model(ids)
        hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
        torch.testing.assert_close(hf(ids).logits, expected, **CLOSE)
        torch.testing.assert_close(to_transformers(compiled)(ids).logits, expected, **CLOSE)


def test_variants_without_llama_equivalent_are_refused(tmp_path):
    model = TransformerLM(300, 32, 64, 2, 4, 128, 10000.0, norm="layernorm")
    with pytest.raises(ValueError, match="norm='layernorm' has no Llama equivalent"):
        export_hf(model, tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_llama_config_refuses_what_llama_cannot_hold_and_eos_ids_that_are_not_token_ids():
    """llama_config is public, but only export_hf and to_transformers checked the model: a LayerNorm
    model with sinusoidal positions got a LlamaForCausalLM config, and eos_token_id 2.5 was written."""
    with pytest.raises(ValueError, match=r"^model: norm='layernorm' has no Llama equivalent"):
        llama_config(ModelConfig(100, 16, 16, 1, 2, norm="layernorm", positions="sinusoidal"))
    with pytest.raises(ValueError, match=r"^model: architecture='encoder_decoder' is a translation model"):
        llama_config(_seq2seq().config)
    for eos in (2.5, -1, 100, True, "2"):
        with pytest.raises(ValueError, match=r"^eos_token_id must be None or a token id in \[0, vocab_size=100\), "
                                             rf"got eos_token_id={re.escape(repr(eos))}$"):
            llama_config(ModelConfig(100, 16, 16, 1, 2), eos_token_id=eos)
    config = llama_config(ModelConfig(100, 16, 16, 1, 2), eos_token_id=np.int64(7))
    assert config["eos_token_id"] == config["bos_token_id"] == 7 and type(config["eos_token_id"]) is int


def test_to_llama_state_dict_checks_num_layers_and_num_heads_against_the_weights():
    """A smaller num_layers had dropped layers silently; num_heads 0 raised ZeroDivisionError and 3 a
    reshape error from inside torch."""
    sd = TransformerLM(100, 16, 16, 2, 2, 32).state_dict()
    assert len(to_llama_state_dict(sd, 2, 2)) == 21
    for layers in (1, 3):
        with pytest.raises(ValueError, match=rf"^num_layers must be the state dict's number of layers, 2, "
                                             rf"got num_layers={layers}$"):
            to_llama_state_dict(sd, layers, 2)
    for name, args in (("num_layers", (0, 2)), ("num_layers", (2.0, 2)), ("num_heads", (2, 0)),
                       ("num_heads", (2, True))):
        with pytest.raises(ValueError, match=rf"^{name} must be a positive integer, got {name}="):
            to_llama_state_dict(sd, *args)
    for heads in (3, 16):  # 16 rows: 3 does not divide them, 16 leaves heads of one row (no RoPE pair)
        with pytest.raises(ValueError, match=r"^num_heads must split the 16 q rows into heads of an even size "
                                             rf"\(RoPE rotates pairs\), got num_heads={heads}$"):
            to_llama_state_dict(sd, 2, heads)
    gap = {k.replace("layers.1.", "layers.2."): v for k, v in sd.items()}
    with pytest.raises(ValueError, match=r"^sd: its layers must be numbered from 0 without a gap, got layers \[0, 2\]"):
        to_llama_state_dict(gap, 2, 2)


def test_cli_names_the_checkpoint_of_a_variant_without_llama_equivalent(tmp_path, capsys):
    """The library's "model: ffn='gelu' ..." named no argument; the command names --checkpoint and the file."""
    checkpoint = tmp_path / "gelu.safetensors"
    export_safetensors(TransformerLM(300, 32, 64, 2, 4, 128, 10000.0, ffn="gelu"), checkpoint)
    assert main(["export", "hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == (f"lm export hf: error: --checkpoint: {str(checkpoint)!r}: ffn='gelu' has no Llama equivalent "
                   "(Llama needs ffn='swiglu')\n"), err
    assert not (tmp_path / "hf").exists()


SEQ2SEQ_VARIANTS = [dict(norm=norm, norm_placement=placement, positions=positions, ffn=ffn)
                    for norm, placement, positions, ffn in itertools.product(
                        ["layernorm", "rmsnorm", "none"], ["post", "pre"], ["sinusoidal", "learned", "rope", "none"],
                        ["relu", "gelu", "silu", "swiglu"])]


def _seq2seq(**variant):
    cfg = Seq2SeqConfig(vocab_size=40, context_length=16, d_model=16, encoder_layers=1, decoder_layers=1, num_heads=2,
                        **variant)
    return build_model(cfg)


def test_encoder_decoders_are_refused_as_translation_models(tmp_path):
    """An encoder–decoder was refused for its norm ("norm='layernorm' has no Llama equivalent", as if
    rmsnorm would do), or, with Llama's choices, ended in AttributeError: 'num_layers'. Every variant
    is now refused for what it is, by both functions, before anything is written."""
    expected = ("model: architecture='encoder_decoder' is a translation model with no Llama equivalent; "
                "Llama export writes decoder-only models (architecture='decoder_lm')")
    for variant in SEQ2SEQ_VARIANTS:
        model = _seq2seq(**variant)
        for export in (lambda m: export_hf(m, tmp_path / "x"), to_transformers):
            with pytest.raises(ValueError) as e:
                export(model)
            assert str(e.value) == expected, (variant, str(e.value))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("variant", [{}, dict(norm="rmsnorm", norm_placement="pre", positions="rope", ffn="swiglu")],
                         ids=["multi30k-defaults", "llama-choices"])
def test_cli_refuses_an_encoder_decoder_in_one_line(tmp_path, capsys, variant):
    checkpoint = tmp_path / "s2s.safetensors"
    export_safetensors(_seq2seq(**variant), checkpoint)
    assert main(["export", "hf", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert err == (f"lm export hf: error: --checkpoint: {str(checkpoint)!r}: architecture='encoder_decoder' is a "
                   "translation model with no Llama equivalent; Llama export writes decoder-only models "
                   "(architecture='decoder_lm')\n"), err
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("extra", ["README.md", "sub/notes.txt", ".git/HEAD"])
def test_overwrite_never_replaces_an_export_the_user_added_to(run, tmp_path, capsys, extra):
    """A marked export with a file (or folder) added to it is not ours any more: --overwrite refuses
    it in one line naming the first such entry, and leaves every file as it was."""
    d, _, _ = run
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out)]) == 0
    (out / extra).parent.mkdir(exist_ok=True)
    (out / extra).write_text("my notes")
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out), "--overwrite"]) == 2
    err = capsys.readouterr().err.strip()
    first = extra.split("/")[0]
    assert f"--out: {str(out)!r} holds files that `lm export hf` did not write ({first!r})" in err, err
    assert len(err.splitlines()) == 1
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # nothing left beside it
    (out / extra).unlink()  # with the user's file gone, a folder it was in still blocks; then the export is ours
    if first != extra:
        assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out), "--overwrite"]) == 2
        capsys.readouterr()
        (out / first).rmdir()
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out), "--overwrite"]) == 0


@pytest.mark.parametrize("extra, spelling", [
    (["--checkpoint", "{run}", "--out", "{hf}", "{other}"], ("OUT_DIR", "{other}", "--out", "{hf}")),
    (["--checkpoint", "{run}", "{other}", "{hf}"], ("CHECKPOINT", "{other}", "--checkpoint", "{run}")),
    (["--out", "{hf}", "{run}", "{other}"], ("OUT_DIR", "{other}", "--out", "{hf}")),
    (["{other}", "--checkpoint", "{run}", "--out", "{hf}"], ("OUT_DIR", "{other}", "--out", "{hf}")),
])
def test_a_thing_given_both_positionally_and_as_an_option_is_refused(tmp_path, capsys, extra, spelling):
    """The deprecated positionals CHECKPOINT OUT_DIR beside --checkpoint/--out: the positional was dropped
    (exit 0) after a line calling it deprecated. Now one line names both spellings, exit 2, nothing written."""
    paths = {"run": str(tmp_path / "run"), "hf": str(tmp_path / "hf"), "other": str(tmp_path / "other")}
    name, old, option, new = (s.format(**paths) for s in spelling)
    assert main(["export", "hf", *(a.format(**paths) for a in extra)]) == 2
    err = capsys.readouterr().err
    assert err == (f"lm export hf: error: {name}: given both positionally ({old!r}) and as {option} ({new!r}); "
                   f"use {option} alone\n"), err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("order", ["option first", "positional first"])
def test_a_lone_positional_beside_checkpoint_is_the_old_out_dir(run, tmp_path, capsys, order):
    """`lm export hf --checkpoint RUN hf/out` took hf/out as a second checkpoint, warned that CHECKPOINT is
    deprecated, then said --out is required. With --checkpoint given, a lone positional is the old OUT_DIR."""
    d, _, _ = run
    out = tmp_path / "hf"
    argv = ["--checkpoint", str(d), str(out)] if order == "option first" else [str(out), "--checkpoint", str(d)]
    assert main(["export", "hf", *argv]) == 0
    err = capsys.readouterr().err
    assert err == "lm export hf: warning: OUT_DIR is deprecated and will be removed; use --out DIR\n", err
    assert (out / "model.safetensors").is_file()


def test_the_deprecated_positional_spelling_still_works(run, tmp_path, capsys):
    d, _, _ = run
    assert main(["export", "hf", str(d), str(tmp_path / "hf")]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "lm export hf: warning: CHECKPOINT is deprecated and will be removed; use --checkpoint PATH",
        "lm export hf: warning: OUT_DIR is deprecated and will be removed; use --out DIR"]
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert main(["export", "hf", str(d), "--out", str(tmp_path / "hf2")]) == 0  # CHECKPOINT with --out
    assert capsys.readouterr().err.splitlines() == [
        "lm export hf: warning: CHECKPOINT is deprecated and will be removed; use --checkpoint PATH"]
    assert (tmp_path / "hf2" / "model.safetensors").is_file()


def test_a_tokenizer_larger_than_the_model_is_refused_before_anything_is_written(run, tmp_path):
    """export_hf wrote a tokenizer.json whose ids (and eos_token_id) went past the model's vocab_size:
    transformers loaded the folder and failed with `IndexError: index out of range` on the first text."""
    _, _, tok = run
    assert tok.vocab_size > 300
    with pytest.raises(ValueError) as e:
        export_hf(TransformerLM(300, 32, 32, 1, 2, None), tmp_path / "hf", tok)
    assert str(e.value) == f"tokenizer: {tok.vocab_size} tokens, more than the model's vocab_size 300"
    assert not any(tmp_path.iterdir())
    export_hf(TransformerLM(330, 32, 32, 1, 2, None), tmp_path / "hf", tok)  # fewer tokens than rows: fine


def _cafe(run):
    """The run's tokenizer with a special token that lm trains, samples and serves with, but that
    Hugging Face's byte-level decoder cannot give back ('é' is a byte's character in its mapping)."""
    from lm.tokenizer import Tokenizer

    _, _, tok = run
    return Tokenizer(tok.vocab, tok.merges, ["<|endoftext|>", "<|café|>"])


CAFE = ("'<|café|>' cannot be saved in tokenizer.json: Hugging Face's byte-level decoder reads 'é' as byte 0xE9 and "
        "would decode the token as '<|caf\ufffd|>'; use a special token without 'é', such as '<|...|>'")


def test_a_special_token_tokenizer_json_cannot_hold_is_refused_before_the_folder_is_made(run, tmp_path, monkeypatch):
    """It was found while tokenizer.json was written, inside the folder being built beside --out, and
    named the Tokenizer's parameter (`special_tokens:`), not export_hf's."""
    import lm.export.hf

    def no_folder(*args, **kwargs):
        raise AssertionError("the folder was being made")

    monkeypatch.setattr(lm.export.hf, "replace_dir", no_folder)
    with pytest.raises(ValueError) as e:
        export_hf(TransformerLM(330, 32, 32, 1, 2, None), tmp_path / "hf", _cafe(run))
    assert str(e.value) == f"tokenizer: {CAFE}"
    assert not any(tmp_path.iterdir())


def test_cli_names_the_tokenizer_folder_of_a_special_token_tokenizer_json_cannot_hold(run, tmp_path, capsys):
    from lm.tokenizer import save_tokenizer_dir

    d = tmp_path / "cafe"
    d.mkdir()
    tok = _cafe(run)
    save_tokenizer_dir(tok, d / "tokenizer")
    export_safetensors(TransformerLM(tok.vocab_size, 32, 32, 1, 2, None), d / "model.safetensors")
    out = tmp_path / "out" / "hf"
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"lm export hf: error: --tokenizer: {str(d / 'tokenizer')!r}: {CAFE}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cafe"]
    (tmp_path / "other").mkdir()  # given as --tokenizer, that folder is named
    save_tokenizer_dir(tok, tmp_path / "other" / "tok")
    assert main(["export", "hf", "--checkpoint", str(d), "--tokenizer", str(tmp_path / "other" / "tok"),
                 "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"lm export hf: error: --tokenizer: {str(tmp_path / 'other' / 'tok')!r}: {CAFE}\n", err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cafe", "other"]


def test_sigterm_during_export_is_one_line_exit_143_and_leaves_no_temporary_folder(run, tmp_path, monkeypatch, capsys):
    """SIGTERM (`kill PID`) killed `lm export hf` at once, leaving the folder being built beside --out
    (.hf.XXXX.tmp, up to a model's size) for good. As Ctrl-C: removed, with one line, exit 143."""
    import safetensors.torch
    from helpers.signals import main_terminated_inside

    d, _, _ = run

    def building():  # config.json is written by now, in .hf.XXXX.tmp
        assert [p.name for p in (tmp_path / "out").iterdir() if p.name.startswith(".hf.")]

    rc = main_terminated_inside(monkeypatch, safetensors.torch, "save",
                                ["export", "hf", "--checkpoint", str(d), "--out", str(tmp_path / "out" / "hf")],
                                check=building)
    assert rc == 143 and capsys.readouterr().err.strip() == "lm export hf: terminated"
    assert not any(tmp_path.iterdir())  # neither .hf.XXXX.tmp nor out/, which the export made


def test_export_into_a_closed_pipe_exits_141_with_the_folder_complete(run, tmp_path):
    """`lm export hf ... | true` exited 2 with "error: [Errno 32] Broken pipe" after a complete export:
    a script checking the status was told it failed. It ends as a Unix tool cut short does: status 141,
    nothing on stderr, and the folder is whole."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    d, _, _ = run
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "lm", "export", "hf", "--checkpoint", str(d), "--out",
                             str(tmp_path / "hf")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the result line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err
    assert {p.name for p in (tmp_path / "hf").iterdir()} == {"config.json", "model.safetensors", "tokenizer.json",
                                                              "tokenizer_config.json", ".lm-output.json"}
    assert transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf") is not None


def test_an_out_that_cannot_be_made_names_out_and_the_users_path(run, tmp_path, capsys):
    """"[Errno 36] File name too long: '.../.aaa….XXXX.tmp'" named neither --out nor the path given,
    but the hidden temporary folder beside it."""
    d, _, _ = run
    out = tmp_path / ("a" * 300)
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == f"lm export hf: error: --out: {str(out)!r} cannot be written: File name too long\n"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("mode", [0o700, 0o750], ids=oct)  # one of them differs from the umask's mode, whatever it is
def test_an_empty_folder_the_user_made_keeps_its_mode(run, tmp_path, capsys, mode):
    """The export was renamed over an empty --out with the usual mode: a private (0700) folder became 0755."""
    import stat

    d, _, _ = run
    out = tmp_path / "private"
    out.mkdir()
    out.chmod(mode)
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out)]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == mode and (out / "model.safetensors").is_file()
    out.chmod(0o711)  # and an earlier export replaced with --overwrite keeps its mode too
    assert main(["export", "hf", "--checkpoint", str(d), "--out", str(out), "--overwrite"]) == 0
    assert stat.S_IMODE(out.stat().st_mode) == 0o711


def test_an_export_without_a_tokenizer_says_so(tmp_path, capsys):
    """A run without data.tokenizer (or a bare .safetensors) gave a folder AutoTokenizer cannot load,
    while --help promised tokenizer.json and tokenizer_config.json: the help says when, and a warning says so."""
    checkpoint = tmp_path / "bare.safetensors"
    export_safetensors(TransformerLM(300, 32, 64, 2, 4, 128, 10000.0), checkpoint)
    out = tmp_path / "hf"
    assert main(["export", "hf", "--checkpoint", str(checkpoint), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith(f"wrote {out}/ (config.json, model.safetensors) from ")
    assert captured.err == (f"lm export hf: warning: no tokenizer (none beside --checkpoint, no --tokenizer given): "
                            f"{str(out)!r} has no tokenizer.json, so transformers' AutoTokenizer cannot load it; "
                            "pass --tokenizer DIR to add one\n")
    with pytest.raises(SystemExit):
        main(["export", "hf", "--help"])
    assert ("when the run has a tokenizer (its tokenizer/) or --tokenizer is given, tokenizer.json and "
            "tokenizer_config.json" in " ".join(capsys.readouterr().out.split()))
    assert "tokenizer_config.json" in export_hf.__doc__.split("\n\n")[0]


@pytest.mark.parametrize(("variant", "key", "value", "needs"), [
    ({"norm_placement": "post"}, "norm_placement", "post", "pre"),
    ({"positions": "learned"}, "positions", "learned", "rope"),
    ({"ffn": "relu"}, "ffn", "relu", "swiglu"),
])
def test_each_choice_llama_cannot_hold_is_refused(tmp_path, variant, key, value, needs):
    """Every architecture choice that Llama's layers cannot hold is refused by name, not only the norm:
    a post-norm RMSNorm/RoPE/SwiGLU model (mut24a H12: norm_placement dropped from the check) was
    exported, and transformers loaded it as a pre-norm Llama with other logits and no error."""
    model = TransformerLM(300, 32, 64, 2, 4, 128, 10000.0, **variant)
    message = rf"^model: {key}='{value}' has no Llama equivalent \(Llama needs {key}='{needs}'\)$"
    with pytest.raises(ValueError, match=message):
        export_hf(model, tmp_path / "x")
    with pytest.raises(ValueError, match=message):
        llama_config(model.config)
    assert not (tmp_path / "x").exists()


def test_a_tokenizer_one_token_larger_than_the_model_is_refused(run, tmp_path):
    """The bound at its edge: a tokenizer of vocab_size + 1 tokens has an id past the embedding (mut24a
    H10: `> vocab_size + 1` passed the test, which used a tokenizer 20 tokens too large); as many
    tokens as rows is fine."""
    _, _, tok = run
    v = tok.vocab_size
    with pytest.raises(ValueError, match=rf"^tokenizer: {v} tokens, more than the model's vocab_size {v - 1}$"):
        export_hf(TransformerLM(v - 1, 32, 32, 1, 2, None), tmp_path / "small", tok)
    assert not (tmp_path / "small").exists()
    export_hf(TransformerLM(v, 32, 32, 1, 2, None), tmp_path / "hf", tok)


def test_the_exported_folder_says_the_models_context_and_end_of_text_to_transformers(run, tmp_path):
    """What transformers reads from the folder besides the weights, against the lm model and tokenizer:
    max_position_embeddings and the tokenizer's model_max_length are the model's context_length (a
    fixed 2048, mut24a H15/H16, passed every test: generate() would run past the trained context with
    no warning), and <|endoftext|> is the tokenizer's eos and bos token (mut24a H17: without them
    AutoTokenizer has no eos_token, and pipelines neither stop nor pad)."""
    _, model, tok = run
    out = export_hf(model, tmp_path / "hf", tok)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.max_position_embeddings == model.config.context_length
    assert config.rms_norm_eps == model.config.norm_eps
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.model_max_length == model.config.context_length
    eot = tok.token_to_id[b"<|endoftext|>"]
    assert (hf_tok.eos_token, hf_tok.eos_token_id) == ("<|endoftext|>", eot)
    assert (hf_tok.bos_token, hf_tok.bos_token_id) == ("<|endoftext|>", eot)
    assert config.eos_token_id == config.bos_token_id == eot
    written = json.loads((out / "config.json").read_text())
    assert written["hidden_act"] == "silu" and written["torch_dtype"] == "float32"


def test_a_bfloat16_model_is_exported_as_float32_weights(tmp_path):
    """config.json says torch_dtype float32: the tensors are written in float32 whatever the model's
    dtype (a bfloat16 model's weights, widened exactly)."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TransformerLM(300, 32, 64, 1, 4, 128, dtype=torch.bfloat16).eval()
    out = export_hf(model, tmp_path / "hf")
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.float32}
    assert torch.equal(tensors["model.embed_tokens.weight"], model.token_embeddings.weight.float())


def test_the_end_of_text_id_is_the_tokenizers_wherever_it_sits(tmp_path):
    """eos_token_id (and bos_token_id) in config.json is the tokenizer's <|endoftext|> id. The CLI test's
    tokenizer, trained by train_bpe, has it at id 0, so a fixed 0 (mut24a H21) passed; a byte-level
    tokenizer holds it after the 256 bytes."""
    from lm.tokenizer import Tokenizer

    tok = Tokenizer({i: bytes([i]) for i in range(256)}, [], ["<|endoftext|>"])
    assert tok.eot_id == 256
    out = export_hf(TransformerLM(300, 32, 32, 1, 2, None), tmp_path / "hf", tok)
    config = transformers.AutoConfig.from_pretrained(out)
    assert config.eos_token_id == config.bos_token_id == 256
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token_id == 256


def test_an_out_in_a_runs_checkpoints_folder_is_refused_and_only_there(tmp_path, capsys):
    """In this process, what test_cli_faults' export test checks from the command line: --out in a
    run's checkpoints/ (a folder of that name beside a config.toml) is refused naming both; a folder
    named checkpoints that is no run's, or a folder beside a run's config.toml, is no checkpoints
    folder (mut31: `and` read as `or` survived). And no checkpoint at all is refused naming --checkpoint."""
    from lm.cli.export import _check_not_in_checkpoints

    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text("")
    (tmp_path / "other" / "checkpoints").mkdir(parents=True)
    for out in (run / "checkpoints" / "hf", run / "checkpoints"):
        with pytest.raises(ValueError) as refused:
            _check_not_in_checkpoints(out)
        assert str(refused.value) == (f"--out: {str(out)!r} is inside {str(run / 'checkpoints')!r}, the checkpoints "
                                      f"folder of the run {str(run)!r}, which `lm train` keeps for its checkpoints "
                                      "alone (it would not resume the run); choose another output")
    for out in (run / "hf", tmp_path / "other" / "checkpoints" / "hf", tmp_path / "hf"):
        _check_not_in_checkpoints(out)
    assert main(["export", "hf", "--out", str(tmp_path / "hf")]) == 2
    assert capsys.readouterr().err == ("lm export hf: error: --checkpoint: required (a checkpoint file or a run "
                                       "directory)\n")
    assert not (tmp_path / "hf").exists()

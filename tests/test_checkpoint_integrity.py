"""Damage outside the tensor data, lying metadata and misnamed files are refused in one line naming
the file (or, for a misnamed but valid file, loaded by what its content is)."""

import json
import zipfile

import pytest
import torch

from lm.checkpoint import export_safetensors, read_checkpoint, write_checkpoint
from lm.checkpoint.io import load_model, tensor_checksum
from lm.model import TransformerLM


def _lm(tie=False):
    torch.manual_seed(0)
    model = TransformerLM(50, 8, 16, 1, 2, 32, tie_embeddings=tie)
    with torch.no_grad():  # untied copies that differ from each other
        if not tie:
            model.lm_head.weight.add_(1.0)
    return model


def _checkpoint(path, model, iteration=7):
    write_checkpoint({"iteration": iteration, "model": model.state_dict(),
                      "config": {"model": model.config.to_dict()}}, path)


def _pickle_offset(path):
    """Offset in the file of the (stored, uncompressed) pickle record of a torch.save zip."""
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
        assert info.compress_type == zipfile.ZIP_STORED
        return info.header_offset + 30 + len(info.filename.encode()) + len(info.extra), info.file_size


def _flip_after(raw: bytearray, start: int, end: int, marker: bytes, old: bytes, new: bytes):
    i = raw.index(marker, start, end) + len(marker)
    j = raw.index(old, i, i + 8)
    raw[j:j + len(old)] = new


# -- (defect 4a) the pickled config and iteration of a .pt ------------------------------------------


@pytest.mark.parametrize("marker, old, new", [(b"num_heads", b"K\x02", b"K\x04"), (b"iteration", b"K\x07", b"Kc")])
def test_a_flipped_byte_in_the_pickled_config_or_iteration_is_refused(tmp_path, marker, old, new):
    path = tmp_path / "c.pt"
    _checkpoint(path, _lm())
    assert load_model(path)[1]["iteration"] == 7
    raw = bytearray(path.read_bytes())
    start, size = _pickle_offset(path)
    _flip_after(raw, start, start + size, marker, old, new)
    bad = tmp_path / "bad.pt"
    bad.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"'.*bad\.pt' is corrupt: the checksum of its config and other values"):
        read_checkpoint(bad)
    with pytest.raises(ValueError, match=r"bad\.pt' is corrupt"):
        load_model(bad)


@pytest.mark.parametrize("key", [b"meta_crc32", b"tensor_crc32"])
def test_a_flipped_bit_in_a_checksum_keys_name_is_refused_not_taken_for_an_older_file(tmp_path, key):
    """ckpt8: `meta_crc32` with one bit flipped (`meta_crc33`) read as a checkpoint from before that
    checksum, so nothing checked the rest: with the iteration changed too, `--resume` went on from
    step 17 with step 20's weights and wrote over step_20.pt and model.safetensors. Every bit of
    both names is flipped in turn, with the iteration changed; not one file loads."""
    path = tmp_path / "c.pt"
    _checkpoint(path, _lm())
    start, size = _pickle_offset(path)
    clean = bytearray(path.read_bytes())
    _flip_after(clean, start, start + size, b"iteration", b"K\x07", b"K\x05")
    at = clean.index(key, start)  # (the local header may be longer than _pickle_offset counts)
    loaded = 0
    for i in range(len(key)):
        for bit in range(8):
            raw = bytearray(clean)
            raw[at + i] ^= 1 << bit
            bad = tmp_path / "bad.pt"
            bad.write_bytes(bytes(raw))
            try:
                read_checkpoint(bad)
                loaded += 1
            except ValueError as e:
                assert "bad.pt" in str(e) and "\n" not in str(e)
    assert loaded == 0


def test_a_checkpoint_written_before_the_config_checksum_still_loads(tmp_path):
    model = _lm()
    state = {"format": "lm-checkpoint", "version": 1, "iteration": 5, "model": model.state_dict(),
             "config": {"model": model.config.to_dict()}}
    state["tensor_crc32"] = tensor_checksum(state)
    torch.save(state, tmp_path / "old.pt")
    loaded, info = load_model(tmp_path / "old.pt")
    assert info["iteration"] == 5
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


def test_optimizer_and_nested_values_round_trip_with_the_checksum(tmp_path):
    from lm.optim import AdamW

    model = _lm()
    opt = AdamW(model.parameters(), lr=1e-2)
    model(torch.randint(0, 50, (2, 8))).float().square().mean().backward()
    opt.step()
    state = {"iteration": 3, "model": model.state_dict(), "optimizer": opt.state_dict(),
             "extra": {"t": (1, 2.5, None, "x"), 3: [float("nan"), True], "3": -0.0}}
    write_checkpoint(state, tmp_path / "c.pt")
    assert read_checkpoint(tmp_path / "c.pt")["iteration"] == 3


def _edited(src, dst, edit):
    """``src`` loaded as torch.load sees it, changed by ``edit``, saved to ``dst`` with its checksums
    unchanged: what a damaged file that still unpickles holds."""
    state = torch.load(src, weights_only=True)
    edit(state)
    torch.save(state, dst)
    return dst


def _set(*keys_and_value):
    *keys, value = keys_and_value

    def edit(state):
        d = state
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return edit


def _rename(old, new):
    return lambda state: state.__setitem__(new, state.pop(old))


_EXTRA = {"list": [1, 2.5, "x"], "tuple": (1, 2), 3: {"flag": True}, "zero": -0.0, "nan": float("nan")}
_META = "is corrupt: the checksum of its config and other values does not match (a damaged file?)"


@pytest.mark.parametrize("edit, why", [
    (_set("extra", "list", [1, 2.0, "x"]), _META),  # an element of a list
    (_set("extra", "list", (1, 2.5, "x")), _META),  # a list read back as a tuple
    (_set("extra", "tuple", (1, 3)), _META),  # an element of a tuple
    (_set("extra", 3, "flag", 1), _META),  # True and 1
    (_set("extra", "zero", 0.0), _META),  # -0.0 and 0.0
    (_set("extra", "nan", float("inf")), _META),
    (lambda state: state["extra"].__setitem__("3", state["extra"].pop(3)), _META),  # a key 3 and "3"
    (_set("iteration", 4), _META),
    (lambda state: state["model"]["lm_head.weight"].view(-1)[0].add_(1.0),
     "is corrupt: the checksum of its tensors does not match (a damaged file?)"),
    (_rename("meta_crc32", "meta_crc33"), "is corrupt: a checksum's entry is damaged ('meta_crc33' is missing or "
     "misspelt), so its contents cannot be checked (a damaged file?)"),
    (lambda state: state.pop("tensor_crc32"), "is corrupt: a checksum's entry is damaged ('tensor_crc32' is missing or "
     "misspelt), so its contents cannot be checked (a damaged file?)"),
], ids=["list-item", "list-as-tuple", "tuple-item", "true-as-1", "minus-zero", "nan", "int-key-as-str", "iteration",
        "tensor", "checksum-name", "no-tensor-checksum"])
def test_any_value_changed_after_the_checksums_is_refused_in_one_line(tmp_path, edit, why):
    """Each kind of value a checkpoint holds (lists and tuples told apart, dict keys of any type,
    bools, signed zeros, NaN) is in a checksum: a change to one after writing is refused, not
    loaded; the file as written, re-saved unchanged, loads."""
    model = _lm()
    write_checkpoint({"iteration": 3, "model": model.state_dict(), "extra": _EXTRA}, tmp_path / "c.pt")
    same = _edited(tmp_path / "c.pt", tmp_path / "same.pt", lambda state: None)
    assert read_checkpoint(same)["extra"]["list"] == [1, 2.5, "x"]
    bad = _edited(tmp_path / "c.pt", tmp_path / "bad.pt", edit)
    with pytest.raises(ValueError) as e:
        read_checkpoint(bad)
    assert str(e.value) == f"{str(bad)!r} {why}"


# -- (defect 4b) exported safetensors record and check CRCs -----------------------------------------


def test_a_flipped_byte_in_exported_tensor_data_is_refused(tmp_path):
    path = export_safetensors(_lm(), tmp_path / "m.safetensors", {"step": "9"})
    assert load_model(path)[1]["iteration"] == 9
    raw = bytearray(path.read_bytes())
    raw[-200] ^= 0x01
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"'.*bad\.safetensors' is damaged: the checksum of its tensors"):
        load_model(tmp_path / "bad.safetensors")


@pytest.mark.parametrize("marker, old, new", [(b"num_heads", b"2", b"4"), (b"step", b"9", b"8")])
def test_edited_exported_metadata_is_refused(tmp_path, marker, old, new):
    path = export_safetensors(_lm(), tmp_path / "m.safetensors", {"step": "9"})
    raw = bytearray(path.read_bytes())
    header_end = 8 + int.from_bytes(raw[:8], "little")
    _flip_after(raw, 8, header_end, marker, old, new)
    (tmp_path / "bad.safetensors").write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"'.*bad\.safetensors' is damaged: the checksum of its metadata"):
        load_model(tmp_path / "bad.safetensors")


def test_safetensors_without_checksums_still_load(tmp_path):
    from safetensors.torch import save_file

    model = _lm()
    save_file(model.state_dict(), tmp_path / "m.safetensors", metadata={"model_config": model.config.to_json()})
    loaded, _ = load_model(tmp_path / "m.safetensors")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# -- (defects 1, 7a) model_config that is not an object, or not a valid config ------------------------


def _save_with_config(path, text, model=None):
    from safetensors.torch import save_file

    model = model or _lm()
    save_file(model.state_dict(), path, metadata={"model_config": text})
    return path


@pytest.mark.parametrize("text", ["[1,2]", "null", "3", '"abc"'])
def test_model_config_that_is_not_an_object_is_one_line_naming_the_file(tmp_path, text):
    path = _save_with_config(tmp_path / "m.safetensors", text)
    with pytest.raises(ValueError, match=r"^'.*m\.safetensors': its 'model_config' metadata is not a JSON object$"):
        load_model(path)


def test_model_config_that_is_not_json_is_one_line_naming_the_file(tmp_path):
    path = _save_with_config(tmp_path / "m.safetensors", "{'d_model': 8")
    with pytest.raises(ValueError) as e:
        load_model(path)
    assert str(e.value) == (f"{str(path)!r}: its 'model_config' metadata is not valid JSON: Expecting property name "
                            "enclosed in double quotes: line 1 column 2 (char 1)")


def test_load_model_tells_the_same_things_of_a_checkpoint_and_of_an_export(tmp_path):
    """load_model's info has the same keys for both kinds of file, each from where that file keeps it."""
    model = _lm()
    cfg = {"model": model.config.to_dict(), "train": {"lr": 0.5}}
    write_checkpoint({"iteration": 7, "model": model.state_dict(), "config": cfg, "tokenizer_sha256": "ab" * 32},
                     tmp_path / "c.pt")
    loaded, info = load_model(tmp_path / "c.pt")
    assert info == {"model_config": model.config.to_dict(), "iteration": 7, "config": cfg,
                    "tokenizer_sha256": "ab" * 32, "metadata": {}}
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    path = export_safetensors(model, tmp_path / "m.safetensors", {"step": "9", "tokenizer_sha256": "cd" * 32})
    _, info = load_model(path)
    meta = info.pop("metadata")
    assert info == {"model_config": json.loads(model.config.to_json()), "iteration": 9, "config": None,
                    "tokenizer_sha256": "cd" * 32}
    assert (meta["step"], meta["tokenizer_sha256"], json.loads(meta["model_config"])) == \
        ("9", "cd" * 32, info["model_config"])
    _, info = load_model(_save_with_config(tmp_path / "bare.safetensors", model.config.to_json()))
    assert (info["iteration"], info["tokenizer_sha256"], info["config"]) == (None, "", None)  # none recorded
    write_checkpoint({"iteration": 7, "model": model.state_dict(), "config": {"train": {}}}, tmp_path / "no_cfg.pt")
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "no_cfg.pt")
    assert str(e.value) == (f"{str(tmp_path / 'no_cfg.pt')!r} records no model config; load it with load_checkpoint "
                            "into a model")
    write_checkpoint({"iteration": 7, "model": model.state_dict(), "config": {"model": ["d_model", 8]}},
                     tmp_path / "list_cfg.pt")
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "list_cfg.pt")
    assert str(e.value) == f"{str(tmp_path / 'list_cfg.pt')!r}: its model config is not a dict"
    two_bad = {k: v.clone() for k, v in model.state_dict().items()}
    first, second = list(two_bad)[:2]
    two_bad[first][0] = float("nan")
    two_bad[second].view(-1)[0] = float("inf")
    write_checkpoint({"iteration": 7, "model": two_bad, "config": {"model": json.loads(model.config.to_json())}},
                     tmp_path / "nan.pt")
    with pytest.raises(ValueError) as e:
        load_model(tmp_path / "nan.pt")
    assert str(e.value) == (f"{str(tmp_path / 'nan.pt')!r}: its weight {first!r} (and 1 more) holds NaN or infinity; "
                            "the run diverged before it was saved: use an earlier checkpoint")


@pytest.mark.parametrize("field, value, why", [("d_ff", -1, "d_ff must be"), ("num_layers", "2", "num_layers must be"),
                                               ("foo", 1, "unknown ModelConfig fields")])
def test_an_invalid_model_config_names_the_file(tmp_path, field, value, why):
    cfg = json.loads(_lm().config.to_json())
    cfg[field] = value
    path = _save_with_config(tmp_path / "m.safetensors", json.dumps(cfg))
    with pytest.raises(ValueError, match=rf"^'.*m\.safetensors': its model config is not valid: {why}"):
        load_model(path)


# -- (defect 3) tie_embeddings with two different copies ----------------------------------------------


def test_tied_config_over_untied_weights_is_refused(tmp_path):
    model = _lm(tie=False)
    cfg = json.loads(model.config.to_json())
    cfg["tie_embeddings"] = True
    path = _save_with_config(tmp_path / "lie.safetensors", json.dumps(cfg), model)
    with pytest.raises(ValueError, match=r"'.*lie\.safetensors': its config ties 'token_embeddings\.weight' and "
                                         r"'lm_head\.weight' \(tie_embeddings\) but the file holds different values"):
        load_model(path)
    # only one of the two copies: refused as well (the other is missing)
    from safetensors.torch import save_file

    sd = {k: v for k, v in model.state_dict().items() if k != "token_embeddings.weight"}
    save_file(sd, tmp_path / "one.safetensors", metadata={"model_config": json.dumps(cfg)})
    with pytest.raises(ValueError, match=r"one\.safetensors' does not fit this model: token_embeddings\.weight is "
                                         "missing"):
        load_model(tmp_path / "one.safetensors")


def test_a_tied_model_round_trips_tied(tmp_path):
    model = _lm(tie=True)
    for path in (export_safetensors(model, tmp_path / "m.safetensors"), tmp_path / "c.pt"):
        if path.suffix == ".pt":
            _checkpoint(path, model)
        loaded, _ = load_model(path)
        assert loaded.lm_head.weight is loaded.token_embeddings.weight
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)


# -- (defect 7c) the reader is chosen by the content ----------------------------------------------


def test_the_reader_is_chosen_by_content_not_by_suffix(tmp_path):
    model = _lm()
    export_safetensors(model, tmp_path / "m.SAFETENSORS")
    export_safetensors(model, tmp_path / "weights.pt")
    _checkpoint(tmp_path / "ckpt.safetensors", model, iteration=4)
    _checkpoint(tmp_path / "ckpt.bin", model, iteration=5)
    for name, it in (("m.SAFETENSORS", None), ("weights.pt", None), ("ckpt.safetensors", 4), ("ckpt.bin", 5)):
        loaded, info = load_model(tmp_path / name)
        assert info["iteration"] == it, name
        assert torch.equal(loaded.lm_head.weight, model.lm_head.weight), name


def test_the_meta_checksum_is_the_crc32_of_the_canonical_text_as_written_here():
    """A checkpoint carries the meta_crc32 it was written with: were the canonical text to change, every
    checkpoint written before would be refused as damaged (mutation: the tensors' tag changed survived;
    every test wrote and read with the same code). The text, spelled out: dicts as their items sorted
    by the key's repr, tuples and lists told apart, a tensor as its dtype and shape, NaN as JSON's
    extension, anything else as its type's name and repr."""
    import zlib

    from lm.checkpoint.io import meta_checksum

    state = {"iteration": 3, "config": {"d_model": 32, "eps": 1e-5, "name": None}, "pair": (1, [2.5, True]),
             "nan": float("nan"), "ids": {1}, "w": torch.zeros(2, 3, dtype=torch.bfloat16)}
    text = ("""["dict",[["'config'",["dict",[["'d_model'",32],["'eps'",1e-05],["'name'",null]]]],"""
            """["'ids'",["repr","set","{1}"]],["'iteration'",3],["'nan'",NaN],"""
            """["'pair'",["tuple",[1,["list",[2.5,true]]]]],["'w'",["tensor","torch.bfloat16",[2,3]]]]]""")
    assert meta_checksum(state) == zlib.crc32(text.encode("utf-8"))

"""Checkpoint files: written atomically, read without unpickling arbitrary objects.

A checkpoint is a ``torch.save`` dictionary holding only tensors and plain Python values::

    {"format": "lm-checkpoint", "version": 1, "iteration": int,
     "model": state_dict, "optimizer": state_dict,
     ...training state added by lm.train: "config", "schedule", "rng", "data", "tokenizer_sha256"}

so ``torch.load(..., weights_only=True)`` reads it and a file received from someone else cannot
run code. ``save_checkpoint`` / ``load_checkpoint`` are the minimal API; the trainer stores its
full state in the same format, so every checkpoint of a run also loads with ``load_checkpoint``,
into an optimizer built as the trainer builds it (``AdamW(lm.optim.param_groups(model, ...))``: one
group with weight decay, one without) or into none.
:func:`load_model` rebuilds a model from a checkpoint or from exported safetensors.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

from lm.checks import is_count
from lm.io import atomic_write

FORMAT = "lm-checkpoint"
VERSION = 1

PathOrFile = str | os.PathLike | IO[bytes]


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module inside DistributedDataParallel and/or torch.compile wrappers."""
    while True:
        if hasattr(model, "module") and isinstance(model.module, nn.Module):  # DDP
            model = model.module
        elif hasattr(model, "_orig_mod"):  # torch.compile
            model = model._orig_mod
        else:
            return model


def tensor_checksum(state: Any) -> int:
    """CRC-32 over the bytes of every tensor in ``state`` (nested dicts and lists, in key order).

    A flipped bit in a checkpoint's tensor data changes it, so a damaged file is refused on
    load instead of resuming a run from silently wrong weights. CRC-32 runs at GB/s: about a
    tenth of a second for a few hundred MB, small beside writing them.
    """
    crc = 0

    def walk(x: Any) -> None:
        nonlocal crc
        if isinstance(x, torch.Tensor):
            t = x.detach().to("cpu").contiguous().reshape(-1)  # 1-D: a 0-d tensor cannot be viewed as bytes
            crc = zlib.crc32(t.view(torch.uint8).numpy() if t.numel() else b"", crc)
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, list | tuple):
            for v in x:
                walk(v)

    walk(state)
    return crc


def _canonical(x: Any) -> Any:
    """A JSON-able image of ``x`` that a ``torch.save``/``torch.load`` round trip preserves: plain
    values as they are, a tensor as its dtype and shape (its bytes are :func:`tensor_checksum`'s),
    dicts as their items sorted by the key's repr, tuples told apart from lists."""
    if x is None or isinstance(x, bool | int | float | str):
        return x
    if isinstance(x, torch.Tensor):
        return ["tensor", str(x.dtype), list(x.shape)]
    if isinstance(x, dict):
        return ["dict", sorted(([repr(k), _canonical(v)] for k, v in x.items()), key=lambda kv: kv[0])]
    if isinstance(x, list):
        return ["list", [_canonical(v) for v in x]]
    if isinstance(x, tuple):
        return ["tuple", [_canonical(v) for v in x]]
    return ["repr", type(x).__name__, repr(x)]


def meta_checksum(state: Any) -> int:
    """CRC-32 of a canonical serialization of everything in ``state`` but the tensors' bytes (the
    config, the iteration, the keys, the tensors' dtypes and shapes...): with :func:`tensor_checksum`,
    a flipped byte anywhere in a checkpoint's values is refused on load."""
    text = json.dumps(_canonical(state), sort_keys=True, separators=(",", ":"), allow_nan=True)
    return zlib.crc32(text.encode("utf-8"))


_CHECKSUM_KEYS = ("tensor_crc32", "meta_crc32")


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the disk full, a file size limit...); nothing was replaced."""


def write_checkpoint(state: dict[str, Any], out: PathOrFile) -> None:
    """``torch.save`` ``state`` with the CRC-32 of its tensors; to a path atomically (temp file, fsync,
    rename). A path that cannot be written raises :class:`CheckpointWriteError` in one line."""
    state = {"format": FORMAT, "version": VERSION, **state}
    body = {k: v for k, v in state.items() if k not in _CHECKSUM_KEYS}
    state = {**body, "tensor_crc32": tensor_checksum(body), "meta_crc32": meta_checksum(body)}
    if isinstance(out, str | os.PathLike):
        try:
            with atomic_write(out, "wb") as f:
                torch.save(state, f)
        except (OSError, RuntimeError) as e:  # torch.save reports a failed write as RuntimeError
            # torch's RuntimeError does not say why ("unexpected pos 832 vs 726"); an OSError does
            hint = "" if isinstance(e, OSError) and e.errno else " (disk full?)"
            raise CheckpointWriteError(f"could not write checkpoint {str(out)!r}: {_first_line(e)}{hint}") from None
    else:
        torch.save(state, out)


def _named(src: PathOrFile) -> str:
    """How a message names ``src``: its path's repr, an open file's by the path it was opened from, or
    "checkpoint" (a file in memory: its repr says nothing)."""
    path = src if isinstance(src, str | os.PathLike) else getattr(src, "name", None)
    return repr(str(path)) if isinstance(path, str | os.PathLike) else "checkpoint"


_ZIP_MAGIC = b"PK\x03\x04"  # a zip archive's first local file header: how every torch.save file starts


def _torch_load(f) -> Any:
    """``torch.load`` of an open binary file, on the CPU, tensors and plain data only. torch.save writes
    a zip archive: a file that starts otherwise (random bytes, a text file) raises _NotTorchSave, where
    torch said "holds objects other than tensors" or "KeyError: 101"."""
    if f.seekable():
        start = f.tell()
        head = f.read(4)
        if len(head) == 4 and head != _ZIP_MAGIC:
            raise _NotTorchSave
        f.seek(start)
    return torch.load(f, map_location="cpu", weights_only=True)


def read_checkpoint(src: PathOrFile) -> dict[str, Any]:
    """Load a checkpoint onto the CPU with ``weights_only=True``; a bad file raises a one-line ValueError."""
    name = _named(src)
    if isinstance(src, str | os.PathLike) and not Path(src).is_file():
        path = Path(src)
        if path.is_dir():
            raise ValueError(f"{name} is a folder, not a checkpoint file")
        if path.is_symlink() and not path.exists():
            raise ValueError(f"{name} is a symbolic link to {os.readlink(path)!r}, which does not exist")
        if path.exists():
            raise ValueError(f"{name} is not a regular file (a pipe, a device...), not a checkpoint file")
        raise ValueError(f"checkpoint not found: {name}")
    try:
        if isinstance(src, str | os.PathLike):
            # an open file, not the path: torch.load reads a path named *.safetensors as safetensors
            with open(src, "rb") as f:
                state = _torch_load(f)
        else:
            state = _torch_load(src)
    except _NotTorchSave:
        raise ValueError(f"{name} is not an lm checkpoint: not a file torch.save writes (a zip archive)") from None
    except Exception as e:  # noqa: BLE001 - a text file or other garbage: torch's unpickler raises anything
        if isinstance(e, pickle.UnpicklingError) and "weights_only" in str(e):
            # torch's message goes on to suggest weights_only=False: not for a file that may run code
            raise ValueError(f"{name} is not a readable checkpoint: it holds objects other than tensors and plain "
                             "data, which an lm checkpoint never does (not unpickled: that could run code)") from None
        raise ValueError(f"{name} is not a readable checkpoint (truncated or corrupt?): {_first_line(e)}") from None
    if not isinstance(state, dict) or state.get("format") != FORMAT or "model" not in state:
        raise ValueError(f"{name} is not an lm checkpoint")
    if state.get("version") != VERSION:
        raise ValueError(f"{name} has checkpoint version {state.get('version')!r}; this lm reads {VERSION}")
    damaged = _damaged_checksum_key(state)
    if damaged is not None or ("meta_crc32" in state and "tensor_crc32" not in state):
        # a damaged key name had read as a checkpoint from before the checksums: nothing checked (ckpt8)
        raise ValueError(f"{name} is corrupt: a checksum's entry is damaged ({damaged or 'tensor_crc32'!r} is "
                         "missing or misspelt), so its contents cannot be checked (a damaged file?)")
    saved = state.pop("tensor_crc32", None)  # absent in checkpoints of earlier versions: not checked
    saved_meta = state.pop("meta_crc32", None)  # absent in checkpoints written before it was added (which hold
    # tensor_crc32 alone, or neither)
    if saved is not None and tensor_checksum(state) != saved:
        raise ValueError(f"{name} is corrupt: the checksum of its tensors does not match (a damaged file?)")
    if saved_meta is not None and meta_checksum(state) != saved_meta:
        raise ValueError(f"{name} is corrupt: the checksum of its config and other values does not match "
                         "(a damaged file?)")
    return state


CHECKSUM_KEYS = ("tensor_crc32", "meta_crc32")


def _damaged_checksum_key(state: dict) -> str | None:
    """A top-level key one or two characters away from a checksum key's name, as a flipped bit or
    byte in the file makes it (``meta_crc33``): the file is damaged, not one written before the
    checksums; None when there is none."""
    for key in state:
        if isinstance(key, str) and key not in CHECKSUM_KEYS:
            for name in CHECKSUM_KEYS:
                if len(key) == len(name) and sum(a != b for a, b in zip(key, name)) <= 2:
                    return key
    return None


class _NotTorchSave(Exception):
    pass


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


def check_state_dict_fits(
    model: nn.Module, state_dict: dict[str, torch.Tensor], name: str = "checkpoint"
) -> None:
    """Raise a one-line ValueError when ``state_dict`` has other keys or shapes than ``model``."""
    own = unwrap(model).state_dict()
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    wrong = [
        f"{k} is {tuple(state_dict[k].shape)} in the checkpoint but {tuple(v.shape)} in the model"
        for k, v in own.items()
        if k in state_dict and tuple(state_dict[k].shape) != tuple(v.shape)
    ]
    problems = [f"{k} is missing" for k in missing] + [f"{k} is not in the model" for k in unexpected] + wrong
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ValueError(f"{name} does not fit this model: {problems[0]}{more}")


def save_checkpoint(
    model: nn.Module, optimizer: torch.optim.Optimizer, iteration: int, out: PathOrFile
) -> None:
    """Save the model's and optimizer's state and the iteration to a path (atomically) or a binary file.

    ``iteration`` is a non-negative integer (NumPy's too), which :func:`load_checkpoint` returns.
    """
    if not is_count(iteration):  # int() had recorded 2.5 as 2, True as 1 and '5' as 5
        raise ValueError(f"iteration must be a non-negative integer, got iteration={iteration!r}")
    write_checkpoint(
        {
            "iteration": int(iteration),
            "model": unwrap(model).state_dict(),
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
        },
        out,
    )


def _config_less(path: Path) -> str:
    """What a safetensors file without lm's model config is, and what to pass instead."""
    if (path.parent / "config.json").is_file():  # transformers' folder: lm export hf wrote it, or another tool
        return ("it is a Hugging Face model (its config.json is beside it: `lm export hf` writes such folders), "
                "which lm does not load back; pass the lm run folder, its model.safetensors or a checkpoint")
    return ("weights without their model's config (not lm train's export; export_safetensors of a bare "
            "state dict writes none), from which lm cannot build the model; pass the run folder, its "
            "model.safetensors or a checkpoint")


def load_checkpoint(src: PathOrFile, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Restore ``model`` and ``optimizer`` (if given) from ``src``; return the saved iteration.

    The model's keys and shapes and the optimizer's parameter groups (their number and sizes) are
    checked before anything is copied, so a checkpoint of another model, or an optimizer grouped
    otherwise than the one saved, raises a one-line ValueError and leaves both as they were.
    A checkpoint of ``lm train`` holds the groups of :func:`lm.optim.param_groups`.
    """
    if isinstance(src, io.IOBase) and src.seekable():
        src.seek(0)
    state = read_checkpoint(src)
    name = _named(src)
    iteration = saved_iteration(state, name, "a checkpoint of save_checkpoint or lm train")
    check_state_dict_fits(model, state["model"], name)
    if optimizer is not None:
        if state.get("optimizer") is None:
            raise ValueError(f"{name} holds no optimizer state")
        check_optimizer_fits(optimizer, state["optimizer"], name)
        optimizer.load_state_dict(state["optimizer"])  # before the model: if torch still refuses, nothing changed
    unwrap(model).load_state_dict(state["model"])
    return iteration


def saved_iteration(state: dict[str, Any], name: str, kind: str) -> int:
    """The step a checkpoint's ``state`` (of :func:`read_checkpoint`) was saved at; a one-line ValueError
    naming the file (``name``) and what it is not (``kind``) when it records none, as a checkpoint written
    by :func:`write_checkpoint` from a dict of its own may not. (read_checkpoint checked its "model".)"""
    if not is_count(state.get("iteration")):
        raise ValueError(f"{name} records no iteration (the step it was saved at); it is not {kind}")
    return int(state["iteration"])


def check_optimizer_fits(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], name: str = "checkpoint"
) -> None:
    """Raise a one-line ValueError when ``state_dict`` (an optimizer's) has other parameter groups
    than ``optimizer``: another number of them, or of parameters in one (what torch's
    ``load_state_dict`` refuses, in words that name neither the file nor the fix)."""
    saved = state_dict.get("param_groups") or []
    want = [len(g.get("params", [])) for g in saved]
    have = [len(g["params"]) for g in optimizer.param_groups]
    if want == have:
        return
    decays = [g["weight_decay"] for g in saved if isinstance(g.get("weight_decay"), int | float)]
    decay = f", weight decay {_and(f'{d:g}' for d in decays)}" if len(decays) == len(saved) else ""
    raise ValueError(f"{name} holds {len(want)} parameter group{'s' if len(want) != 1 else ''} ({_and(want)} "
                     f"parameters{decay}) but the optimizer has {len(have)} ({_and(have)} parameters); build it as "
                     "lm train does: AdamW(lm.optim.param_groups(model, weight_decay))")


def _and(items) -> str:
    """``1``, ``1 and 2``, ``1, 2 and 3``."""
    items = [str(x) for x in items]
    return " and ".join(items) if len(items) < 3 else ", ".join(items[:-1]) + " and " + items[-1]


SAFETENSORS_CHECKSUM_KEYS = ("tensor_crc32", "metadata_crc32")


def safetensors_checksums(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, str]:
    """The checksum entries :func:`lm.checkpoint.export_safetensors` adds to a file's metadata: the
    CRC-32 of its tensors' bytes (by name) and of its other metadata (``model_config``, ``step``...)."""
    rest = {k: v for k, v in metadata.items() if k not in SAFETENSORS_CHECKSUM_KEYS}
    text = json.dumps(rest, sort_keys=True, separators=(",", ":"))
    return {"tensor_crc32": str(tensor_checksum(tensors)), "metadata_crc32": str(zlib.crc32(text.encode("utf-8")))}


def _check_safetensors_checksums(name: str, state_dict: dict[str, torch.Tensor], meta: dict[str, str]) -> None:
    """Refuse a file whose recorded checksums do not match (files without them are not checked)."""
    if not any(k in meta for k in SAFETENSORS_CHECKSUM_KEYS):
        return
    want = safetensors_checksums(state_dict, meta)
    for key, what in (("tensor_crc32", "its tensors"), ("metadata_crc32", "its metadata (model_config...)")):
        if meta.get(key) != want[key]:
            raise ValueError(f"{name} is damaged: the checksum of {what} does not match (a damaged file?)")


@contextlib.contextmanager
def safetensors_name(path: str | os.PathLike) -> Iterator[str]:
    """A name of ``path`` that the safetensors library opens: the path itself, or, when it is not
    UTF-8 (a Latin-1 folder name, held as lone surrogates), the file opened here and named through
    ``/proc/self/fd`` where there is one. The library refused such a path ("Path ... is not valid
    UTF-8"), so a run folder of that name could not be sampled from its export (clifuzz9)."""
    name = os.fspath(path)
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        if os.path.isdir("/proc/self/fd"):
            fd = os.open(name, os.O_RDONLY)
            try:
                yield f"/proc/self/fd/{fd}"
            finally:
                os.close(fd)
            return
    yield name


def sniff_format(path: str | os.PathLike) -> str | None:
    """``"pt"`` for a zip (``torch.save``) file, ``"safetensors"`` for a safetensors header (an 8-byte
    little-endian length, then ``{``), None when the content says neither (or cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return None
    if head[:4] == _ZIP_MAGIC:
        return "pt"
    if len(head) == 9 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") > 0:
        return "safetensors"
    return None


def _tied_copies_differ(model: nn.Module, state_dict: dict[str, torch.Tensor]) -> list[str] | None:
    """The names of a group of state-dict entries that are one tensor in ``model`` (tied weights)
    but hold different values in ``state_dict``; None when every such group agrees."""
    groups: dict[tuple, list[str]] = {}
    for k, v in model.state_dict(keep_vars=True).items():
        if v.numel():
            groups.setdefault((v.data_ptr(), v.dtype, tuple(v.shape)), []).append(k)
    for names in groups.values():
        present = [k for k in names if k in state_dict]
        if len(present) > 1 and not all(torch.equal(state_dict[present[0]], state_dict[k]) for k in present[1:]):
            return present
    return None


def load_model(
    path: str | os.PathLike, device: str | torch.device = "cpu"
) -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild a model (the one its config's architecture names) from a checkpoint (``.pt``) or an
    exported ``.safetensors`` file.

    Returns ``(model, info)``, the model in eval mode. ``info`` has the same keys for both
    kinds of file: ``model_config`` (a dict), ``iteration`` (None when not recorded), ``config``
    (the run's config dict, None for safetensors), ``tokenizer_sha256`` ("" when not recorded)
    and ``metadata`` (the safetensors metadata, {} for checkpoints).
    """
    from lm.model import build_model, model_config_from_dict

    path = Path(path)
    kind = sniff_format(path) or ("safetensors" if path.suffix.lower() == ".safetensors" else "pt")
    if kind == "safetensors":
        import safetensors
        from safetensors import safe_open
        from safetensors.torch import load_file

        # A truncated or corrupt file raises safetensors' own error (an Exception, not a ValueError).
        unreadable = (OSError, ValueError, RuntimeError, getattr(safetensors, "SafetensorError", ValueError))
        try:
            with safetensors_name(path) as name:
                with safe_open(name, "pt") as f:
                    meta = f.metadata() or {}
                state_dict = load_file(name)
        except unreadable as e:
            raise ValueError(f"{str(path)!r} is not a readable safetensors file: {e}") from None
        _check_safetensors_checksums(repr(str(path)), state_dict, meta)
        if "model_config" not in meta:
            raise ValueError(f"{str(path)!r} has no 'model_config' metadata: {_config_less(Path(path))}")
        try:
            model_cfg = json.loads(meta["model_config"])
        except ValueError as e:
            raise ValueError(f"{str(path)!r}: its 'model_config' metadata is not valid JSON: {e}") from None
        if not isinstance(model_cfg, dict):
            raise ValueError(f"{str(path)!r}: its 'model_config' metadata is not a JSON object")
        step = meta.get("step")
        info = {
            "model_config": model_cfg,
            "iteration": int(step) if step and step.isdigit() else None,
            "config": None,
            "tokenizer_sha256": meta.get("tokenizer_sha256", ""),
            "metadata": meta,
        }
    else:
        state = read_checkpoint(path)
        model_cfg = (state.get("config") or {}).get("model")
        if model_cfg is None:
            raise ValueError(
                f"{str(path)!r} records no model config; load it with load_checkpoint into a model"
            )
        if not isinstance(model_cfg, dict):
            raise ValueError(f"{str(path)!r}: its model config is not a dict")
        state_dict = state["model"]
        info = {
            "model_config": model_cfg,
            "iteration": state.get("iteration"),
            "config": state.get("config"),
            "tokenizer_sha256": state.get("tokenizer_sha256", ""),
            "metadata": {},
        }
    bad = [name for name, t in state_dict.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:  # sampling or scoring with them gives NaN, or a plausible argmax of garbage
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise ValueError(f"{str(path)!r}: its weight {bad[0]!r}{more} holds NaN or infinity; the run diverged "
                         "before it was saved: use an earlier checkpoint")
    try:
        model = build_model(model_config_from_dict(model_cfg), device=device)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{str(path)!r}: its model config is not valid: {e}") from None
    check_state_dict_fits(model, state_dict, repr(str(path)))
    differ = _tied_copies_differ(model, state_dict)
    if differ:  # load_state_dict would copy each into the one shared tensor: the last would win
        raise ValueError(f"{str(path)!r}: its config ties {_and(repr(k) for k in differ)} (tie_embeddings) but "
                         "the file holds different values for them: the config does not match the weights")
    model.load_state_dict(state_dict)
    return model.eval(), info

"""The training configuration: dataclasses read from TOML, checked key by key.

One dataclass per TOML table; the dataclasses are the single source of truth for names,
types and defaults, and ``configs/*.toml`` document every option. ``[model]`` is
:class:`lm.model.ModelConfig` itself. Unknown keys and values of the wrong type are errors
that name the key and suggest the closest known one.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from lm.checks import SEED_MAX
from lm.io import check_readable_file, spoken_list
from lm.model import ARCHITECTURES, ModelConfig, Seq2SeqConfig
from lm.nn.choices import check_choice
from lm.tomlio import dump_tables
from lm.tomlio import loads as toml_loads


@dataclass
class DataConfig:
    train: str = ""  # token file (.bin with its .json sidecar) written by `lm tokenize`; required
    val: str | None = None  # validation token file; no evaluation without it
    tokenizer: str | None = None  # tokenizer folder (vocab.json, merges.txt), copied into the run


@dataclass
class TrainConfig:
    out_dir: str = "runs/default"  # run directory: config, metrics, checkpoints
    batch_size: int = 32  # sequences per process per micro-step (language models)
    batch_tokens: int | None = None  # encoder-decoder: padded tokens per process per micro-step
    grad_accum_steps: int = 1  # micro-steps per optimizer step
    max_steps: int | None = None  # stop after this many optimizer steps ...
    max_time: float | None = None  # ... or after this many seconds of training steps, whichever comes first
    # (evaluation, checkpoints and compilation are not counted: the wall clock runs longer)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    dtype: str = "auto"  # autocast dtype: auto (bfloat16 where supported, else float32) | bfloat16 | float32
    compile: bool = False  # torch.compile the model
    # Bitwise-reproducible training (same config and seed, same thread count: same weights, and
    # an exact --resume). CPU kernels are deterministic anyway; on CUDA this turns on torch's
    # deterministic algorithms and CUBLAS_WORKSPACE_CONFIG=:4096:8 (see lm/train/determinism.py).
    deterministic: bool = True
    # torchrun: seconds a process waits for the others in a collective (a frozen or swapping peer,
    # a long evaluation on rank 0) before it stops; default: torch's (30 min on gloo, 10 min on nccl)
    dist_timeout: float | None = None


@dataclass
class OptimConfig:
    max_lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100  # in schedule iterations (steps when max_steps drives the schedule)
    cosine_cycle_iters: int | None = None  # default: max_steps; the schedule's length
    schedule: str = "cosine"  # cosine | wsd (warm-up, stable, linear decay) | inverse_sqrt (Vaswani et al.)
    decay_fraction: float = 0.2  # wsd: the final share of the schedule that decays to min_lr
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # on matrices only; norms, biases and embeddings get none
    decay_embeddings: bool = False  # also decay the embedding tables (nanoGPT does)
    grad_clip: float = 1.0  # max global L2 norm of the gradients; 0 disables clipping


@dataclass
class EvalConfig:
    interval: int = 500  # steps between evaluations (and at the end); 0 disables
    batches: int = 20  # fixed validation batches per evaluation
    batch_size: int | None = None  # default: train.batch_size
    batch_tokens: int | None = None  # encoder-decoder: default train.batch_tokens
    seed: int = 1234  # picks the fixed validation windows


@dataclass
class CheckpointConfig:
    interval: int = 1000  # steps between checkpoints (also at the end and on SIGINT/SIGTERM); 0: end only
    keep_last: int = 3  # step checkpoints kept; 0 keeps all
    keep_best: bool = True  # also keep best.pt, the lowest validation loss so far
    export_safetensors: bool = True  # write RUN_DIR/model.safetensors at the end


@dataclass
class LogConfig:
    interval: int = 10  # steps between console lines and train records in metrics.jsonl
    peak_tflops: float | None = None  # device peak for MFU; default: a table of known GPUs / a CPU estimate


@dataclass
class WandbConfig:
    mode: str = "disabled"  # disabled | offline | online
    project: str = "lm"
    name: str | None = None  # default: the run directory's name


@dataclass
class Config:
    """A training run: ``[model]`` (a :class:`ModelConfig` or :class:`Seq2SeqConfig`), ``[data]``,
    ``[train]``, ``[optim]``, ``[eval]``, ``[checkpoint]``, ``[log]`` and ``[wandb]``."""

    model: ModelConfig | Seq2SeqConfig
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: LogConfig = field(default_factory=LogConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return {f.name: dataclasses.asdict(getattr(self, f.name)) for f in dataclasses.fields(self)}

    def to_toml(self) -> str:
        """The resolved configuration as TOML; unset (None) options are written as comments."""
        return dump_tables(self.to_dict())


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "optim": OptimConfig,
    "eval": EvalConfig,
    "checkpoint": CheckpointConfig,
    "log": LogConfig,
    "wandb": WandbConfig,
}
_REQUIRED = {("data", "train")}


def _closest(name: str, options: list[str]) -> str | None:
    """The option closest to ``name``, compared in lower case: ``D_MODEL`` is ``d_model`` (difflib
    alone had offered ``d_ff``, and nothing for ``MODEL``: cli21)."""
    lowered = {option.lower(): option for option in options}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.5)
    return lowered[close[0]] if close else None


def _suggest(name: str, options: list[str]) -> str:
    close = _closest(name, options)
    return f" (did you mean {close!r}?)" if close else ""


def _suggest_in(section: str, key: str, names: list[str]) -> str:
    """A key of ``section`` close to ``key``, compared without the shared ``section.`` (which made
    "model.label_smoothing" look like "model.vocab_size")."""
    close = _closest(key, names)
    return f" (did you mean {f'{section}.{close}'!r}?)" if close else ""


# Names other trainers use (nanoGPT, litgpt, Hugging Face) for what is a key, or a flag, here. String
# similarity alone led them astray: optim.lr was "did you mean 'optim.min_lr'?", and a nanoGPT user
# who took that set the schedule's floor, not its peak, with no error.
_FOREIGN_NAMES: dict[str, str] = {
    **dict.fromkeys(("lr", "learning_rate", "peak_lr"), "optim.max_lr"),
    **dict.fromkeys(("block_size", "seq_len", "max_seq_len", "max_seq_length", "n_ctx", "n_positions",
                     "max_position_embeddings"), "model.context_length"),
    **dict.fromkeys(("n_embd", "n_embed", "dim", "hidden_size", "emb_dim", "d_embed"), "model.d_model"),
    **dict.fromkeys(("n_layer", "n_layers", "num_hidden_layers"), "model.num_layers"),
    **dict.fromkeys(("n_head", "n_heads", "num_attention_heads"), "model.num_heads"),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "hidden_dim", "d_hidden"), "model.d_ff"),
    **dict.fromkeys(("lr_decay_iters", "lr_decay_steps", "decay_steps"), "optim.cosine_cycle_iters"),
    **dict.fromkeys(("warmup_steps", "lr_warmup_steps", "warmup"), "optim.warmup_iters"),
    **dict.fromkeys(("max_iters", "train_iters", "num_steps", "max_train_steps"), "train.max_steps"),
    **dict.fromkeys(("eval_iters", "eval_batches", "eval_steps"), "eval.batches"),
    "eval_interval": "eval.interval", "log_interval": "log.interval",
    **dict.fromkeys(("gradient_accumulation_steps", "grad_accum", "gradient_accumulation_iters"),
                    "train.grad_accum_steps"),
    **dict.fromkeys(("micro_batch_size", "per_device_train_batch_size"), "train.batch_size"),
    "min_learning_rate": "optim.min_lr", "adam_beta1": "optim.beta1", "adam_beta2": "optim.beta2",
    **dict.fromkeys(("max_grad_norm", "gradient_clip_val", "clip_grad"), "optim.grad_clip"),
    "wandb_project": "wandb.project", "wandb_run_name": "wandb.name",
    **dict.fromkeys(("threads", "num_threads"), "--threads"),
    **dict.fromkeys(("resume", "init_from", "resume_from_checkpoint"), "--resume"),
}


def _foreign_name(key: str, known: list[str]) -> str:
    """`` (did you mean 'optim.max_lr'?)`` for a name another trainer uses; "" for none."""
    target = _FOREIGN_NAMES.get(key.lower())
    if target is None:
        return ""
    if target.startswith("--"):
        return f" (that is lm train's {target} flag, not a config key)"
    if target in known:
        return f" (did you mean {target!r}?)"
    if target == "model.num_layers" and "model.encoder_layers" in known:  # an encoder_decoder has two stacks
        return " (did you mean 'model.encoder_layers' and 'model.decoder_layers'?)"
    return ""


# What ``--resume`` may change: how long the run goes on and how it is watched, run and recorded.
# Everything else (data, batch, seed, dtype, optimizer and schedule, model...) shapes the
# trajectory: a resumed run keeps it, so that it ends where the uninterrupted run does.
RESUME_MAY_CHANGE = (
    "train.out_dir", "train.max_steps", "train.max_time", "train.device", "train.compile", "train.dist_timeout",
    "data.tokenizer",
    "eval.interval", "checkpoint.*", "log.*", "wandb.*",
)


def _may_change(key: str) -> bool:
    return key in RESUME_MAY_CHANGE or f"{key.split('.')[0]}.*" in RESUME_MAY_CHANGE


def resume_changes(saved: dict[str, Any], cfg: Config, checkpoint: str,
                   same: Callable[[str, Any, Any], bool] | None = None) -> dict[str, tuple[Any, Any]]:
    """The settings that differ between a checkpoint's config ``saved`` and ``cfg``, as
    ``{key: (saved value, new value)}``; a ValueError naming the first that ``--resume`` may not
    change (see :data:`RESUME_MAY_CHANGE`). Keys a checkpoint does not record are not compared.

    ``same(key, saved value, new value)`` may accept a value that is spelled differently but
    means the same (a data file by another path): such a change is returned, not refused."""
    changes = {}
    for section, values in cfg.to_dict().items():
        old_values = saved.get(section)
        if section == "model" or not isinstance(old_values, dict):  # the model is checked with its weights
            continue
        for name, new in values.items():
            key = f"{section}.{name}"
            if name not in old_values or old_values[name] == new:
                continue
            if not _may_change(key) and not (same is not None and same(key, old_values[name], new)):
                raise ValueError(
                    f"--resume: {key} is {spelled(old_values[name])} in {checkpoint} but {spelled(new)} in the config; "
                    f"a resumed run keeps what shapes its training (it may change only {', '.join(RESUME_MAY_CHANGE)})"
                )
            changes[key] = (old_values[name], new)
    return changes


def spelled(value: Any) -> str:
    """A config value as the TOML file spells it, for messages: ``true``/``false``, ``unset`` for a key
    left out (None), a quoted string, a number as it is (not Python's True, False and None)."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _all_keys(model_cls: type = ModelConfig) -> list[str]:
    classes = {**SECTIONS, "model": model_cls}
    return [f"{s}.{f.name}" for s, cls in classes.items() for f in dataclasses.fields(cls)]


def _unoptional(annotation: Any) -> Any:
    """``X`` for ``X | None`` (``Optional[X]``), else ``annotation`` as it is."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(annotation) if a is not type(None)]
        return inner[0] if len(inner) == 1 else annotation
    return annotation


def _check_type(where: str, value: Any, annotation: Any) -> Any:
    """Return ``value`` as a plain ``int``/``float``/``str`` or raise a ValueError: ints widen to
    float where a float is wanted, and numpy's numbers (from a Python-API sweep) become Python's,
    which config.toml and a checkpoint can hold (a numpy scalar in a checkpoint fails ``--resume``)."""
    annotation = _unoptional(annotation)
    if annotation is bool:
        ok = isinstance(value, (bool, np.bool_))
    elif isinstance(value, bool):  # an int, but no number here
        ok = False
    elif annotation is int:
        ok = isinstance(value, numbers.Integral)
    elif annotation is float:
        ok = isinstance(value, numbers.Real)
    else:
        ok = isinstance(value, annotation)
    if not ok:
        unset = f" (--set {where}=none leaves it unset)" if _unsettable(*where.split(".")) else ""
        raise ValueError(f"config: {where} must be {_type_name(annotation)}, got {type(value).__name__} {value!r}"
                         f"{unset}")
    if annotation is float and isinstance(value, numbers.Integral):
        try:
            return float(value)
        except OverflowError:  # a whole number past float's range (hundreds of digits)
            raise ValueError(f"config: {where} must be a number within float range, got an integer of "
                             f"{len(str(abs(value)))} digits") from None
    if annotation in (int, float, str, bool) and type(value) is not annotation:
        return annotation(value)
    return value


def _type_name(annotation: Any) -> str:
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        annotation, str(annotation)
    )


def _build(section: str, cls: type, values: dict[str, Any], arch: str | None = None) -> Any:
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    known = _all_keys(cls if section == "model" else ModelConfig)
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            # The right key in the wrong table; a name another trainer uses; a key that is the start of a
            # known one; a key of the other architecture; else the closest spelling.
            moved = [k for k in known if k.endswith(f".{key}") and k != f"{section}.{key}"]
            # this table's own keys first: "[optim] grad" had been offered train.grad_accum_steps, not
            # optim.grad_clip, and "[log] inte" eval.interval, as [train] and [eval] come first
            start = sorted((k for k in known if k.split(".")[1].startswith(key) and len(key) >= 4),
                           key=lambda k: k.split(".")[0] != section)
            other = [a for a, (c, _) in ARCHITECTURES.items() if section == "model" and c is not cls
                     and key in {f.name for f in dataclasses.fields(c)}]
            hint = (
                (f" (did you mean {moved[0]!r}?)" if moved else "")
                or _foreign_name(key, known)
                or (f" (did you mean {start[0]!r}?)" if start else "")
                or _suggest_in(section, key, names)
                or (f" (a key of model.architecture = {other[0]!r})" if other else "")
                or _suggest(f"{section}.{key}", known)
            )
            where = f" for model.architecture {arch!r}" if arch and arch != "decoder_lm" else ""
            raise ValueError(f"config: unknown key {section}.{key}{where}{hint}")
        kwargs[key] = _check_type(f"{section}.{key}", value, hints[key])
    for s, k in _REQUIRED:
        if s == section and k not in kwargs:
            raise ValueError(f"config: missing required key {s}.{k}")
    missing = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in kwargs
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:  # required fields without a default: named here, not in TypeError's grammar
        raise ValueError(f"config: [{section}] is missing {spoken_list([repr(m) for m in missing])}")
    try:
        return cls(**kwargs)
    except ValueError as e:
        raise ValueError(f"config: [{section}] {e}") from None


def parse_override(item: str) -> tuple[str, str, Any]:
    """``"optim.max_lr=3e-4"`` -> ``("optim", "max_lr", 3e-4)``; a value that is not TOML is a string."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected section.key=value")
    key, raw = item.split("=", 1)
    key = key.strip()
    if key.count(".") != 1:
        raise ValueError(f"--set {item!r}: the key must be section.key, e.g. optim.max_lr")
    section, name = key.split(".")
    # TOML's spaces around "=" are the user's, not the value's: "train.out_dir = runs/b" had made a
    # folder named " runs" (clifuzz9 #6); a value with spaces of its own is quoted, as in TOML
    text = raw.strip()
    try:
        value = toml_loads(f"v = {raw}")["v"]
    except ValueError:  # tomllib.TOMLDecodeError
        if text[:1] in ("'", '"'):  # an unclosed quote had become part of a path: a folder '"runs'
            raise ValueError(f"--set {item!r}: the value starts with a quote but is not a valid TOML string (a "
                             "quote left open, or a backslash TOML does not allow); fix it, or leave the quotes "
                             "out") from None
        value = text  # bare strings such as paths: --set train.out_dir=runs/x
        if _DECIMAL.fullmatch(text):  # ".5", "5.": numbers to a user, though not to TOML
            value = float(text)
    if not isinstance(value, str) and _is_str_key(section, name):
        value = text  # --set train.out_dir=123, --set wandb.name=2024-01-01: the text as typed
    return section, name, value


_DECIMAL = re.compile(r"[+-]?(\d+\.\d*|\.\d+)([eE][+-]?\d+)?")


def _classes(section: str) -> list[type]:
    """The dataclasses that may hold the keys of ``section`` (every architecture's, for [model])."""
    if section == "model":
        return [cls for cls, _ in ARCHITECTURES.values()]
    return [SECTIONS[section]] if section in SECTIONS else []


def _is_str_key(section: str, name: str) -> bool:
    """Whether ``section.name`` holds text (in any model architecture's config, for [model])."""
    for cls in _classes(section):
        if _unoptional(typing.get_type_hints(cls).get(name)) is str:
            return True
    return False


def _unsettable(section: str, name: str) -> bool:
    """Whether ``section.name`` may be left unset (``X | None``): ``--set section.name=none`` takes it
    out, as deleting its line from the TOML file would; a path key too (``data.val=none``: no
    evaluation; a file so named is ``./none``). A text key that may not be unset keeps the word
    (``model.norm=none`` is a choice)."""
    for cls in _classes(section):
        hint = typing.get_type_hints(cls).get(name)
        if hint is not None and _unoptional(hint) is not hint:
            return True
    return False


UNSET = ("none", "null")  # --set train.max_time=none: the key left out (TOML has no null)


def config_from_dict(raw: dict[str, Any], overrides: list[str] = ()) -> Config:
    """Build and check a :class:`Config` from parsed TOML plus ``section.key=value`` overrides;
    ``section.key=none`` (or ``null``) takes out a key that may be unset, such as ``train.max_time`` or
    ``data.val`` (a file so named is ``./none``; a text key that may not be unset keeps the word:
    ``model.norm=none`` is a choice)."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        section, name, value = parse_override(item)
        raw.setdefault(section, {})
        if not isinstance(raw[section], dict):
            raise ValueError(f"config: {section} must be a table ([{section}])")
        if isinstance(value, str) and value.strip().lower() in UNSET and _unsettable(section, name):
            raw[section].pop(name, None)
            continue
        raw[section][name] = value
    sections = {}
    for section, values in raw.items():
        if section not in SECTIONS and not isinstance(values, dict):  # `max_steps = 5` above the first table
            known = _all_keys()
            moved = [k for k in known if k.split(".", 1)[1] == section]
            hint = (f" (did you mean {moved[0]!r}, under [{moved[0].split('.')[0]}]?)" if moved else
                    _foreign_name(section, known) or _suggest(section, known))
            raise ValueError(f"config: {section} = {spelled(values)} is outside any table{hint}")
        if section not in SECTIONS:
            raise ValueError(f"config: unknown section [{section}]{_suggest(section, list(SECTIONS))}")
        if not isinstance(values, dict):
            raise ValueError(f"config: {section} must be a table ([{section}]), got {values!r}")
        cls = SECTIONS[section]
        if section == "model":  # the architecture picks the config class
            values = dict(values)
            arch = values.get("architecture", "decoder_lm")
            check_choice("config: model.architecture", arch, ARCHITECTURES)
            cls = ARCHITECTURES[arch][0]
            if arch == "decoder_lm":
                values.pop("architecture", None)
            sections[section] = _build(section, cls, values, arch)
            continue
        sections[section] = _build(section, cls, values)
    if "model" not in sections:
        raise ValueError("config: missing section [model]")
    for section, cls in SECTIONS.items():
        if section not in sections:
            sections[section] = _build(section, cls, {})
    cfg = Config(**sections)
    _check_values(cfg)
    return cfg


def check_config(cfg: Config) -> Config:
    """``cfg`` checked as a config file is, and returned as a new :class:`Config`: types, values,
    numpy's numbers made Python's. What :class:`~lm.train.Trainer` runs, so that a config built or
    changed in Python gets the checks of one read from TOML: a sweep's ``cfg.optim.max_lr = lr`` over
    ``np.logspace`` had put a numpy scalar in every checkpoint, which then none could load, and
    ``LogConfig(interval=0)`` had been a ZeroDivisionError once the run folder was made (train20)."""
    if not isinstance(cfg, Config):
        raise ValueError(f"cfg: expected an lm.train.Config, got {type(cfg).__name__}")
    raw: dict[str, Any] = {}
    for f in dataclasses.fields(cfg):
        section = getattr(cfg, f.name)
        if not dataclasses.is_dataclass(section):
            raise ValueError(f"config: [{f.name}] must be a {SECTIONS[f.name].__name__}, got {type(section).__name__}")
        raw[f.name] = {g.name: getattr(section, g.name) for g in dataclasses.fields(section)
                       if g.init and getattr(section, g.name) is not None}  # None: unset, every such key's default
    architecture = getattr(cfg.model, "architecture", "decoder_lm")
    if architecture != "decoder_lm":
        raw["model"]["architecture"] = architecture
    return config_from_dict(raw)


def load_config(path: str | os.PathLike, overrides: list[str] = ()) -> Config:
    """Read a TOML config file, apply ``--set`` overrides, and check everything; a path that is no
    readable file (a folder, a symlink loop) is a one-line error naming --config, for every caller."""
    path = check_readable_file(path, "--config")
    try:
        raw = toml_loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:  # removed since the check
        raise ValueError(f"--config: file not found: {str(path)!r}") from None
    except OSError as e:  # unreadable after all (an I/O error, a permission os.access did not foresee)
        raise ValueError(f"--config: cannot read {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise ValueError(f"--config: {str(path)!r} is not a TOML file (not UTF-8 text)") from None
    except ValueError as e:  # tomllib.TOMLDecodeError (UnicodeDecodeError, a ValueError too, is above)
        raise ValueError(f"--config: {str(path)!r} is not valid TOML: {e}") from None
    return config_from_dict(raw, overrides)


def name_options(message: str, options: dict[str, str], args: Any) -> str:
    """A config error prefixed with the command-line options that set the keys it names, with their
    values as given (``--d-model 130``): ``options`` maps a key (``d_model``) to its option
    (``--d-model``), ``args`` holds the parsed options (argparse's namespace). For scripts that
    build a config from their own options, so that the error names what the user typed."""
    import re

    named = []
    for key in re.findall(r"[a-z][a-z0-9_]*", message):
        option = options.get(key)
        if option is not None:
            given = f"{option} {getattr(args, option[2:].replace('-', '_'))}"
            if given not in named:
                named.append(given)
    return f"{', '.join(named)}: {message}" if named else message


MAX_GRAD_ACCUM = 2**31 - 1  # train.grad_accum_steps: far past any run (a step would take weeks)
# eval.batches: the token windows' starts of every batch are drawn at start-up (about ten seconds for a
# million) and kept (lm.train.memory checks their size); a pair plan takes at most its own batches, so a
# million covers any validation set
MAX_EVAL_BATCHES = 1_000_000
MAX_DIST_TIMEOUT = 30 * 24 * 3600


def _check_values(cfg: Config) -> None:
    t, o = cfg.train, cfg.optim

    def positive(where: str, value: float | None, allow_zero: bool = False) -> None:
        if value is None:
            return
        # 0 and inf are what one tries for "no limit": the way to say it, where there is one
        tried = value == 0 or (isinstance(value, float) and math.isinf(value))
        unset = f" (--set {where}=none leaves it unset)" if tried and _unsettable(*where.split(".")) else ""
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"config: {where} must be a finite number, got {value}{unset}")
        if value < 0 or (value == 0 and not allow_zero):
            raise ValueError(f"config: {where} must be {'>= 0' if allow_zero else '> 0'}, got {value}{unset}")

    if t.max_steps is None and t.max_time is None:
        raise ValueError("config: set train.max_steps or train.max_time (or both)")
    for name, seed in (("train.seed", t.seed), ("eval.seed", cfg.eval.seed)):
        if not 0 <= seed <= SEED_MAX:
            raise ValueError(f"config: {name} must be a whole number in [0, 2**64-1], got {seed}")
    positive("train.max_steps", t.max_steps)
    positive("train.max_time", t.max_time)
    positive("train.dist_timeout", t.dist_timeout)
    if t.dist_timeout is not None and t.dist_timeout > MAX_DIST_TIMEOUT:  # timedelta overflows past ~2.7e12 days
        raise ValueError(f"config: train.dist_timeout must be at most {MAX_DIST_TIMEOUT:,} seconds (30 days), "
                         f"got {t.dist_timeout:g}")
    positive("train.batch_size", t.batch_size)
    positive("train.grad_accum_steps", t.grad_accum_steps)
    if t.grad_accum_steps > MAX_GRAD_ACCUM:  # torch could not even divide the loss by one past 2**63
        raise ValueError(f"config: train.grad_accum_steps must be at most 2**31 - 1 (the micro-batches of one "
                         f"optimizer step: that many would take weeks), got {t.grad_accum_steps:,}")
    positive("optim.max_lr", o.max_lr)
    positive("optim.min_lr", o.min_lr, allow_zero=True)
    positive("optim.warmup_iters", o.warmup_iters, allow_zero=True)
    positive("optim.cosine_cycle_iters", o.cosine_cycle_iters)
    positive("optim.grad_clip", o.grad_clip, allow_zero=True)
    positive("optim.eps", o.eps)
    if o.min_lr > o.max_lr:
        raise ValueError(f"config: optim.min_lr ({o.min_lr}) must not exceed optim.max_lr ({o.max_lr})")
    for name, beta in (("optim.beta1", o.beta1), ("optim.beta2", o.beta2)):
        if not (math.isfinite(beta) and 0 <= beta < 1):
            raise ValueError(f"config: {name} must be in [0, 1), got {beta}")
    positive("optim.weight_decay", o.weight_decay, allow_zero=True)
    positive("eval.interval", cfg.eval.interval, allow_zero=True)
    positive("eval.batches", cfg.eval.batches)
    if cfg.eval.batches > MAX_EVAL_BATCHES:
        raise ValueError(f"config: eval.batches must be at most {MAX_EVAL_BATCHES:,} (the batches are drawn and held "
                         f"from the start, and every evaluation runs them all), got {cfg.eval.batches:,}")
    positive("eval.batch_size", cfg.eval.batch_size)
    positive("checkpoint.interval", cfg.checkpoint.interval, allow_zero=True)
    positive("checkpoint.keep_last", cfg.checkpoint.keep_last, allow_zero=True)
    positive("log.interval", cfg.log.interval)
    positive("log.peak_tflops", cfg.log.peak_tflops)
    if (o.schedule != "inverse_sqrt" and o.cosine_cycle_iters is not None and o.warmup_iters > o.cosine_cycle_iters
            and (t.max_steps is None or t.max_steps > o.warmup_iters)):  # numerics20
        raise ValueError(f"config: optim.warmup_iters ({o.warmup_iters}) is longer than optim.cosine_cycle_iters "
                         f"({o.cosine_cycle_iters}), and the run goes on past the warm-up: the rate would climb to "
                         f"nearly optim.max_lr until step {o.warmup_iters}, then drop to optim.min_lr at once; "
                         f"make the warm-up shorter than the cycle")
    if t.max_steps is None and o.cosine_cycle_iters is None and o.schedule != "inverse_sqrt":
        raise ValueError("config: with train.max_time alone, set optim.cosine_cycle_iters (the schedule's length)")
    positive("train.batch_tokens", t.batch_tokens)
    positive("eval.batch_tokens", cfg.eval.batch_tokens)
    if cfg.model.architecture == "encoder_decoder" and t.batch_tokens is None:
        raise ValueError("config: an encoder_decoder model trains on batches of sentence pairs: set train.batch_tokens")
    if cfg.model.architecture == "encoder_decoder":  # a row count there would be ignored: refuse one that is set
        for key, value, default, instead in (
                ("train.batch_size", t.batch_size, TrainConfig.batch_size, "train.batch_tokens"),
                ("eval.batch_size", cfg.eval.batch_size, EvalConfig.batch_size, "eval.batch_tokens")):
            if value != default:
                raise ValueError(f"config: {key} applies to a decoder_lm model; an encoder_decoder model is batched "
                                 f"by {instead} (sentence pairs up to a token budget), got {key} = {value}")
    if not t.out_dir.strip():
        raise ValueError(f"config: train.out_dir must name a folder, got {t.out_dir!r}")
    if "\0" in t.out_dir:  # no path holds one: the OS refuses it ("embedded null byte", naming nothing)
        raise ValueError(f"config: train.out_dir must be a path without a NUL byte, got {t.out_dir!r}")
    if cfg.model.architecture != "encoder_decoder":  # token windows: batch_size rows, never a token budget
        for key, value, instead in (("train.batch_tokens", t.batch_tokens, "train.batch_size"),
                                    ("eval.batch_tokens", cfg.eval.batch_tokens, "eval.batch_size")):
            if value is not None:
                raise ValueError(f'config: {key} applies to model.architecture = "encoder_decoder" only; '
                                 f"a {cfg.model.architecture} model is batched by {instead}")
    if o.schedule == "inverse_sqrt" and o.warmup_iters < 1:
        raise ValueError(f"config: optim.schedule = inverse_sqrt needs optim.warmup_iters >= 1, got {o.warmup_iters}")
    check_choice("config: train.dtype", t.dtype, ("auto", "float32", "bfloat16"))
    check_choice("config: optim.schedule", cfg.optim.schedule, ("cosine", "wsd", "inverse_sqrt"))
    if not 0 < cfg.optim.decay_fraction <= 1:
        raise ValueError(f"config: optim.decay_fraction must be in (0, 1], got {cfg.optim.decay_fraction}")
    check_choice("config: wandb.mode", cfg.wandb.mode, ("disabled", "offline", "online"))
    project = cfg.wandb.project  # only wandb reads it: a disabled run's config keeps whatever it held
    if cfg.wandb.mode != "disabled" and (
        not isinstance(project, str) or not 0 < len(project) <= 128 or any(c in project for c in "/\\#?%:")
    ):
        raise ValueError(f"config: wandb.project must be a name of 1 to 128 characters without any of / \\ # ? % :, "
                         f"got {project!r}")
    if not cfg.data.train:
        raise ValueError("config: missing required key data.train")
    # An empty path is not "left out": taken for it, --set data.val=$UNSET_VARIABLE trained with no
    # evaluation, said nothing, and --resume then refused the file as a change of the run's data.
    for key, value, what, unset in (("data.val", cfg.data.val, "a token file", "no evaluation"),
                                    ("data.tokenizer", cfg.data.tokenizer, "a tokenizer folder", "no tokenizer")):
        if value is not None and not value.strip():
            raise ValueError(f"config: {key} must name {what} (leave the key out, or --set {key}=none, for {unset}), "
                             f"got {value!r}")

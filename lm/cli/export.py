"""``lm export hf``: a Hugging Face Llama folder from a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lm.cli.common import add_checkpoint, add_command, add_out, add_quiet

EXAMPLES = """
  lm export hf --checkpoint runs/cpu-small --out hf/cpu-small
  lm export hf --checkpoint runs/cpu-small --out hf/cpu-small --overwrite   # replace an earlier export
  python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/cpu-small')"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "export", help="export a model to another format", description="Export a trained model.",
                    examples=EXAMPLES)
    esub = p.add_subparsers(dest="export_format", metavar="FORMAT", required=True)
    h = add_command(
        esub,
        "hf",
        help="a folder that transformers loads as LlamaForCausalLM",
        description="Write config.json and model.safetensors (q/k rows permuted to Llama's rotate-half RoPE) "
        "into the --out folder, which transformers.AutoModelForCausalLM.from_pretrained loads as Llama, and, when "
        "the run has a tokenizer (its tokenizer/) or --tokenizer is given, tokenizer.json and "
        "tokenizer_config.json, which AutoTokenizer loads (without them a warning says so). The folder is built "
        "beside --out and renamed into place when complete; --overwrite replaces only an earlier export.",
        examples=EXAMPLES,
    )
    add_checkpoint(h, required=False)
    add_out(h, "the folder to write", metavar="DIR", required=False)
    h.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    add_quiet(h)
    # the 0.1 spelling: lm export hf CHECKPOINT OUT_DIR. Which positional is which is known only once
    # --checkpoint is (see _old_positionals), so the deprecation lines come from the command, not the parser.
    h.add_argument("old_checkpoint", nargs="?", metavar="CHECKPOINT", help=argparse.SUPPRESS)
    h.add_argument("old_out", nargs="?", metavar="OUT_DIR", help=argparse.SUPPRESS)
    h.set_defaults(func=cmd_export_hf)


def _old_positionals(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """The checkpoint and the output folder from the options and the deprecated positionals.

    Two positionals are CHECKPOINT OUT_DIR. One is CHECKPOINT, unless --checkpoint is given: then it
    is OUT_DIR (``lm export hf --checkpoint RUN hf/out``). A thing given both as an option and
    positionally is refused, naming both; each positional used gets its deprecation line.
    """
    given = [x for x in (args.old_checkpoint, args.old_out) if x is not None]
    if len(given) == 2 or (given and args.checkpoint is None):
        old_checkpoint, old_out = (given + [None])[:2]
    else:
        old_checkpoint, old_out = None, (given[0] if given else None)
    for name, old, option, new in (("CHECKPOINT", old_checkpoint, "--checkpoint", args.checkpoint),
                                   ("OUT_DIR", old_out, "--out", args.out)):
        if old is not None and new is not None:
            raise ValueError(f"{name}: given both positionally ({old!r}) and as {option} ({new!r}); "
                             f"use {option} alone")
    for name, old, new in (("CHECKPOINT", old_checkpoint, "--checkpoint PATH"), ("OUT_DIR", old_out, "--out DIR")):
        if old is not None:
            print(f"lm export hf: warning: {name} is deprecated and will be removed; use {new}", file=sys.stderr)
    return args.checkpoint or old_checkpoint, args.out or old_out


def _check_not_in_checkpoints(out: Path) -> None:
    """Refuse an ``out`` inside the ``checkpoints/`` folder of an ``lm train`` run (one beside a
    ``config.toml``), whichever checkpoint is exported: ``lm train`` keeps that folder for its
    checkpoints alone, and refused to resume the run once an export sat there (faults20)."""
    where = out.resolve()
    for folder in (where, *where.parents):
        if folder.name == "checkpoints" and (folder.parent / "config.toml").is_file():
            raise ValueError(f"--out: {str(out)!r} is inside {str(folder)!r}, the checkpoints folder of the run "
                             f"{str(folder.parent)!r}, which `lm train` keeps for its checkpoints alone (it would "
                             "not resume the run); choose another output")


def cmd_export_hf(args: argparse.Namespace) -> int:
    from lm.cli.tokenizer import terminate_as_interrupt

    # SIGTERM as Ctrl-C: the folder being built beside --out (.NAME.*.tmp) is removed, exit 143
    return terminate_as_interrupt("lm export hf", lambda: _cmd_export_hf(args))


def _cmd_export_hf(args: argparse.Namespace) -> int:
    from lm.cli.common import load_model_and_tokenizer
    from lm.export import export_hf
    from lm.generate.load import find_run_tokenizer
    from lm.io import writing_out

    checkpoint, out = _old_positionals(args)
    if checkpoint is None:
        raise ValueError("--checkpoint: required (a checkpoint file or a run directory)")
    if out is None:
        raise ValueError("--out: required (the folder to write)")
    # the folder, not the file resolve_checkpoint picks in it: a run that is training may delete that
    # file before it is read, and the loader then picks again
    loaded = load_model_and_tokenizer(checkpoint, args.tokenizer, device="cpu", need_tokenizer=False)
    model, tok, _ = loaded
    path = loaded.path
    from lm.export.hf import check_llama_compatible

    try:  # architecture first, then norm, positions or FFN: named as the checkpoint's, not as the library's `model`
        check_llama_compatible(model.config)
    except ValueError as e:
        raise ValueError(f"--checkpoint: {str(path)!r}: {str(e).removeprefix('model: ')}") from None
    inputs = [("--checkpoint", path)] + ([("--tokenizer", args.tokenizer)] if args.tokenizer else [])
    _check_not_in_checkpoints(Path(out))
    try:
        with writing_out(out):  # the model is in memory: an OSError is one of writing --out
            written = export_hf(model, out, tok, overwrite=args.overwrite, inputs=inputs)
    except ValueError as e:  # the tokenizer's fault (a special token tokenizer.json cannot hold): name its folder
        if not str(e).startswith("tokenizer: "):
            raise
        folder = args.tokenizer or find_run_tokenizer(loaded.path)
        raise ValueError(f"--tokenizer: {str(folder)!r}: {str(e).removeprefix('tokenizer: ')}") from None
    files = "config.json, model.safetensors" + (", tokenizer.json, tokenizer_config.json" if tok else "")
    print(f"wrote {written}/ ({files}) from {loaded.source}")
    if tok is None:
        print(f"lm export hf: warning: no tokenizer (none beside --checkpoint, no --tokenizer given): {str(written)!r} "
              "has no tokenizer.json, so transformers' AutoTokenizer cannot load it; pass --tokenizer DIR to add one",
              file=sys.stderr)
    return 0

"""``lm export hf``: a Hugging Face Llama folder from a checkpoint."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lm export hf runs/cpu-small hf/cpu-small
  python -c "from transformers import AutoModelForCausalLM; AutoModelForCausalLM.from_pretrained('hf/cpu-small')"
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("export", help="export a model to another format",
                       description="Export a trained model.")
    esub = p.add_subparsers(dest="export_format", metavar="FORMAT", required=True)
    h = esub.add_parser(
        "hf",
        help="a folder that transformers loads as LlamaForCausalLM",
        description="Write config.json, model.safetensors (q/k rows permuted to Llama's rotate-half RoPE) and "
        "tokenizer.json into OUT_DIR, which transformers.AutoModelForCausalLM.from_pretrained loads as Llama.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    h.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint file or run directory")
    h.add_argument("out_dir", metavar="OUT_DIR")
    h.add_argument("--tokenizer", default=None, metavar="DIR", help="default: the run's tokenizer/")
    h.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT_DIR")
    h.set_defaults(func=cmd_export_hf)


def cmd_export_hf(args: argparse.Namespace) -> int:
    from lm.cli.common import load_model_and_tokenizer
    from lm.export import export_hf

    model, tok, _ = load_model_and_tokenizer(args.checkpoint, args.tokenizer, need_tokenizer=False)
    out = export_hf(model, args.out_dir, tok, overwrite=args.overwrite)
    print(f"wrote {out}/ (config.json, model.safetensors{', tokenizer.json' if tok else ''})")
    return 0

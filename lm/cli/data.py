"""``lm data download``: fetch data sets into ``data/``."""

from __future__ import annotations

import argparse

from lm.cli.common import add_command, add_out, add_quiet

EXAMPLES = """
  lm data download tinystories                 # the 22 MB validation split, into data/
  lm data download tinystories --split train   # the 2.2 GB training split (resumable)
  lm data download tinystories --out /scratch/data
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "data", help="download data sets", description="Download data sets into data/.",
                    examples=EXAMPLES)
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    d = add_command(
        dsub,
        "download",
        help="download a data set",
        description="Download TinyStoriesV2-GPT4 text from the Hugging Face dataset roneneldan/TinyStories. "
        "Resumable: run again after an interruption. The size and SHA-256 are checked before the file "
        "gets its final name; a complete file already there is kept.",
        examples=EXAMPLES,
    )
    d.add_argument("dataset", choices=["tinystories"])
    d.add_argument("--split", choices=["valid", "train"], default="valid")
    add_out(d, "the folder to put the file in", default="data", metavar="DIR", old="--out-dir")
    add_quiet(d)
    d.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from lm.data.download import download_tinystories

    path = download_tinystories(args.split, args.out, progress=not args.quiet, overwrite=args.overwrite)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0

"""``lm data download``: fetch data sets into ``data/``."""

from __future__ import annotations

import argparse

EXAMPLES = """examples:
  lm data download tinystories                 # the 22 MB validation split
  lm data download tinystories --split train   # the 2.2 GB training split (resumable)
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("data", help="download data sets", description="Download data sets into data/.")
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    d = dsub.add_parser(
        "download",
        help="download a data set",
        description="Download TinyStoriesV2-GPT4 text from the Hugging Face dataset roneneldan/TinyStories. "
        "Resumable: run again after an interruption. The size and SHA-256 are checked before the file "
        "gets its final name.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d.add_argument("dataset", choices=["tinystories"])
    d.add_argument("--split", choices=["valid", "train"], default="valid")
    d.add_argument("--out-dir", default="data", metavar="DIR", help="where to put the file (default: data)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from lm.data.download import download_tinystories

    path = download_tinystories(args.split, args.out_dir, progress=not args.quiet)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0

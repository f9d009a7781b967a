"""``lm data download``: fetch data sets into ``data/``."""

from __future__ import annotations

import argparse

from lm.cli.common import add_command, add_out, add_quiet

EXAMPLES = """
  lm data download tinystories                 # the 22 MB validation split, into data/
  lm data download tinystories --split train   # the 2.2 GB training split (resumable)
  lm data download tinystories --out /scratch/data
  lm data download multi30k                    # En-De translation, 6 files (1.3 MB), into data/multi30k/
  LM_TINYSTORIES_URL=https://mirror.example/tinystories lm data download tinystories   # from a mirror
  LM_MULTI30K_URL=file:///data/copies/multi30k lm data download multi30k               # from a local copy
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = add_command(sub, "data", help="download data sets", description="Download data sets into data/.",
                    examples=EXAMPLES)
    dsub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    d = add_command(
        dsub,
        "download",
        help="download a data set",
        description="Download TinyStoriesV2-GPT4 text from the Hugging Face dataset roneneldan/TinyStories, or "
        "Multi30k En-De (task 1, raw: {train,val,test_2016_flickr}.{en,de}.gz) from the GitHub repository "
        "multi30k/dataset. Resumable: run again after an interruption. The size and SHA-256 are checked before "
        "a file gets its final name; a file the server says, or shows, is of another size is refused at once, "
        "not fetched again. A complete file already there is kept (checked against the SHA-256 where one is "
        "known; kept with a warning when offline); another file there is replaced only with --overwrite, and only "
        "once the new one is complete. The environment variables LM_TINYSTORIES_URL and LM_MULTI30K_URL replace "
        "the base URL (the folder that holds the files, by their usual names) with a mirror's, or with a file:// "
        "URL of a local copy; the multi30k files are still checked against their pinned sizes and SHA-256.",
        examples=EXAMPLES,
    )
    d.add_argument("dataset", choices=["tinystories", "multi30k"],
                   help="tinystories: TinyStoriesV2-GPT4 text, one split; multi30k: Multi30k English-German, "
                   "all splits")
    d.add_argument("--split", choices=["valid", "train"], default=None,
                   help="tinystories only: which split (default: valid); multi30k downloads all its splits")
    add_out(d, "the folder to put the files in (default: data, or data/multi30k for multi30k)", required=False,
            metavar="DIR", old="--out-dir")
    add_quiet(d)
    d.set_defaults(func=cmd_download)


def cmd_download(args: argparse.Namespace) -> int:
    from lm.data.download import download_multi30k, download_tinystories

    if args.out == "":  # had been taken as the current folder, not the default
        raise ValueError("--out: must not be empty; omit --out for the default (data, or data/multi30k)")
    if args.dataset == "multi30k":
        if args.split is not None:
            raise ValueError(f"--split: multi30k has no --split (it downloads all of its 6 files, 1.3 MB), "
                             f"got {args.split!r}")
        out = args.out if args.out is not None else "data/multi30k"
        paths = download_multi30k(out, progress=not args.quiet, overwrite=args.overwrite)
    else:
        out = args.out if args.out is not None else "data"
        paths = [download_tinystories(args.split or "valid", out, progress=not args.quiet, overwrite=args.overwrite)]
    for path in paths:
        print(f"{path} ({_size(path.stat().st_size)})")
    return 0


def _size(n: int) -> str:
    """A byte count in MB, or in kB below 1 MB (where MB would print Multi30k's 22 kB files as 0.0 MB).

    >>> _size(21_650), _size(22_565_424)
    ('21.6 kB', '22.6 MB')
    """
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"

"""Write docs/api.md, the reference of lm's public names, and docs/cli.md, the reference of its
command line, from the packages and the parsers themselves.

    python scripts/make_api_docs.py              # rewrites docs/api.md and docs/cli.md
    python scripts/make_api_docs.py --check      # exit 1 if either is not what it would write

A package's public names are its ``__all__``; each gets its signature (names and defaults) and
the first sentence of its docstring. Each command gets its ``--help``, as ``lm`` prints it on a
terminal 100 columns wide. ``tests/test_api_docs.py`` checks that both files are up to date and
that every name in api.md imports, so neither reference can drift from the code.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import os
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "api.md"
CLI_OUT = REPO / "docs" / "cli.md"
CLI_COLUMNS = 100  # the terminal width the help is formatted for (argparse reads $COLUMNS)
PACKAGES = ["lm.tokenizer", "lm.nn", "lm.model", "lm.optim", "lm.data", "lm.train", "lm.checkpoint",
            "lm.evaluate", "lm.generate", "lm.serve", "lm.export"]


def first_sentence(doc: str | None) -> str:
    if not doc:
        return ""
    para = inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " ").strip()
    # the first ". " before a capital letter or markup, not after "et al" or "a.k.a"
    end = re.search(r"(?<!\bal)(?<!a\.k\.a)(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(:])", para)
    text = para if end is None else para[: end.start() + 1]
    return text.replace("|", "\\|")


def signature(obj) -> str:
    if getattr(obj, "_is_protocol", False) or inspect.isclass(obj) and issubclass(obj, BaseException):
        return ""  # a typing.Protocol (an interface) or an exception: nothing to construct by hand
    # a class's __init__, or the class itself where it has none of its own (a NamedTuple's is __new__)
    target = obj.__init__ if inspect.isclass(obj) and obj.__init__ is not object.__init__ else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return ""
    parts, star = [], False
    for p in sig.parameters.values():
        if p.name == "self":
            continue
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.kind is p.VAR_POSITIONAL:
            parts.append(f"*{p.name}")
            star = True
        elif p.kind is p.VAR_KEYWORD:
            parts.append(f"**{p.name}")
        elif p.default is p.empty:
            parts.append(p.name)
        else:
            parts.append(f"{p.name}={p.default!r}")
    return "(" + ", ".join(parts) + ")"


def kind(obj) -> str:
    if inspect.isclass(obj):
        return "class"
    if callable(obj):
        return "function"
    return "constant"


def render() -> str:
    out = ["# API reference", "",
           "The public names of `lm`, package by package: each package's `__all__`, with its signature and",
           "the first sentence of its docstring. Written by `python scripts/make_api_docs.py` from the code;",
           "`tests/test_api_docs.py` fails when this page and the code disagree. The command line's reference",
           "is [cli.md](cli.md).", ""]
    for name in PACKAGES:
        module = importlib.import_module(name)
        out += [f"## `{name}`", "", first_sentence(module.__doc__), "",
                "| name | kind | signature | what it is |", "|---|---|---|---|"]
        for public in module.__all__:
            obj = getattr(module, public)
            sig = signature(obj) if kind(obj) != "constant" else ""
            if kind(obj) == "constant":
                doc = f"`{obj!r}`".replace("|", "\\|")
            else:
                doc = first_sentence(getattr(obj, "__doc__", None))
            out.append(f"| `{public}` | {kind(obj)} | `{sig}` | {doc} |" if sig else
                       f"| `{public}` | {kind(obj)} | | {doc} |")
        out.append("")
    return "\n".join(out)


@contextlib.contextmanager
def _columns(width: int):
    """A terminal ``width`` columns wide, as argparse's help formatter sees it."""
    before = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if before is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = before


def render_cli() -> str:
    from lm.cli import build_parser
    from lm.cli.common import commands

    out = ["# Command-line reference", "",
           f"Every `lm` command's `--help`, as it prints on a terminal {CLI_COLUMNS} columns wide: what the command "
           "does,", "its options with their defaults, and examples. Written by `python scripts/make_api_docs.py` "
           "from the", "parsers; `tests/test_api_docs.py` fails when this page and the code disagree. How the "
           "commands fit", 'together (inputs, `--out`, `--overwrite`, exit statuses) is in the README\'s "The '
           'command line".', ""]
    with _columns(CLI_COLUMNS):
        found = list(commands(build_parser()))
        out += ["| command | what it does |", "|---|---|"]
        for path, _ in found[1:]:
            out.append(f"| [`{' '.join(path)}`](#{'-'.join(path)}) | {_summary(found, path)} |")
        out.append("")
        for path, parser in found:
            out += [f'<a id="{"-".join(path)}"></a>', "", f"## `{' '.join(path)}`", "", "```text",
                    parser.format_help().rstrip("\n"), "```", ""]
    return "\n".join(out)


def _summary(found, path: tuple[str, ...]) -> str:
    """The one line the command's group lists it with (``lm --help``'s COMMAND list)."""
    parent = dict(found)[path[:-1]]
    for action in parent._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == path[-1]:
                    return (choice.help or "").replace("|", "\\|")
    return ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    pages = [(OUT, render()), (CLI_OUT, render_cli())]
    if args.check:
        stale = [path for path, text in pages
                 if not path.exists() or path.read_text(encoding="utf-8") != text]
        for path, _ in pages:
            name = path.relative_to(REPO)
            print(f"{name} is stale: run python scripts/make_api_docs.py" if path in stale
                  else f"{name} is up to date")
        return 1 if stale else 0
    for path, text in pages:
        path.parent.mkdir(exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)  # the page is generated: replacing it is this command's job
        print(path)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())

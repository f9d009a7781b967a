"""Write docs/api.md, the reference of lm's public names, from the packages themselves.

    python scripts/make_api_docs.py              # rewrites docs/api.md
    python scripts/make_api_docs.py --check      # exit 1 if docs/api.md is not what it would write

A package's public names are its ``__all__``; each gets its signature (names and defaults) and
the first sentence of its docstring. ``tests/test_api_docs.py`` checks that the file is up to date
and that every name in it imports, so the reference cannot drift from the code.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "docs" / "api.md"
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
           "`tests/test_api_docs.py` fails when this page and the code disagree. The command line is in the",
           "README (`lm --help` and `lm COMMAND --help` have every option).", ""]
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="compare instead of writing")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print("docs/api.md is up to date" if same else "docs/api.md is stale: run python scripts/make_api_docs.py")
        return 0 if same else 1
    OUT.parent.mkdir(exist_ok=True)
    tmp = OUT.with_name(OUT.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(OUT)  # the page is generated: replacing it is this command's job
    print(OUT)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    raise SystemExit(main())

"""docs/api.md, the reference of the public names, and docs/cli.md, the command line's, are what the
code says: regenerated they are the same files, every name in api.md imports from its package, and
the CS336 interface's names are all in it."""

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

from helpers.scripts import load_script

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "api.md"

# The names the CS336 interface promises (its adapters import them): they must stay public.
INTERFACE = {
    "lm.tokenizer": ["Tokenizer", "train_bpe"],
    "lm.nn": ["Linear", "Embedding", "RMSNorm", "SwiGLU", "RotaryEmbedding", "MultiHeadSelfAttention",
              "TransformerBlock", "softmax", "silu", "scaled_dot_product_attention", "cross_entropy"],
    "lm.model": ["TransformerLM"],
    "lm.optim": ["AdamW", "cosine_lr_schedule", "clip_grad_norm_"],
    "lm.data": ["get_batch"],
    "lm.checkpoint": ["save_checkpoint", "load_checkpoint"],
    "lm.generate": ["generate"],
}


def documented() -> dict[str, list[str]]:
    names: dict[str, list[str]] = {}
    package = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        if m := re.match(r"## `(lm[\w.]*)`", line):
            package = m.group(1)
            names[package] = []
        elif package and (m := re.match(r"\| `(\w+)` \|", line)):
            names[package].append(m.group(1))
    return names


def test_the_reference_is_what_the_generator_writes_from_the_code():
    r = subprocess.run([sys.executable, str(REPO / "scripts" / "make_api_docs.py"), "--check"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_documented_name_imports_and_every_public_name_is_documented():
    names = documented()
    assert len(names) >= 10 and sum(map(len, names.values())) > 80
    for package, public in names.items():
        module = importlib.import_module(package)
        for name in public:
            assert hasattr(module, name), f"{package}.{name} is documented but does not import"
        assert sorted(public) == sorted(module.__all__), package
    for package, promised in INTERFACE.items():
        assert set(promised) <= set(names[package]), (package, set(promised) - set(names[package]))


def test_docstrings_cite_the_repository_not_files_beside_it():
    for path in (REPO / "lm").rglob("*.py"):
        assert "API.md" not in path.read_text(encoding="utf-8"), path


def test_every_signature_in_the_reference_names_its_parameters():
    """Seq2SeqCache and create_app were listed as `(*args, **kwargs)`, from which nobody can call them."""
    opaque = [line.split("|")[1].strip() for line in DOC.read_text(encoding="utf-8").splitlines()
              if "`(*args, **kwargs)`" in line]
    assert opaque == [], opaque


def test_the_command_line_reference_is_every_commands_help_in_this_process(monkeypatch):
    """docs/cli.md is each command's --help as lm prints it, sentence by sentence: made here, from the
    parsers of this process (the --check above runs another), so that a change to a help text, a
    metavar or a default that the page does not show fails here (mutation testing had found such
    changes unseen: only the presence of each help was tested). $COLUMNS is the generator's own."""
    from lm.cli import build_parser
    from lm.cli.common import commands

    monkeypatch.setenv("COLUMNS", "33")  # the page's width is the generator's, whatever the terminal's
    make = load_script("make_api_docs.py")
    page = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    assert make.render_cli() == page, "docs/cli.md is stale: run python scripts/make_api_docs.py"
    assert os.environ["COLUMNS"] == "33"  # and the generator put the terminal's back
    found = dict(commands(build_parser()))
    assert {" ".join(path) for path in found} >= {"lm", "lm sample", "lm train", "lm serve", "lm export hf"}
    for path in found:  # each command's section, its help verbatim
        assert f"## `{' '.join(path)}`" in page
    monkeypatch.setenv("COLUMNS", str(make.CLI_COLUMNS))
    assert f"```text\n{found[('lm', 'sample')].format_help().rstrip()}\n```" in page

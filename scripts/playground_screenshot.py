"""A screenshot of the playground (``lm serve``'s page at ``/``) after a completion, taken by the
same headless Chromium the tests drive (Debian's ``chromium``, through Playwright).

    python scripts/playground_screenshot.py --checkpoint runs/demo/run --out docs/playground.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

from lm.cli.common import WrittenHelpParser
from lm.serve.process import free_port, start_server


def save_screenshot(page, out: Path) -> None:
    """The page's screenshot at ``out``, written to a temporary name beside it and renamed: never a
    half-written ``out``, and no temporary file left when the write or the rename fails."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp.png")
    try:
        page.screenshot(path=str(tmp), full_page=True)
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after the rename


def main() -> int:
    ap = WrittenHelpParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="a run folder or checkpoint to serve")
    ap.add_argument("--out", default="docs/playground.png")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("--prompt", default="Once upon a time")
    ap.add_argument("--seed", default="3")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    out = Path(args.out)
    if out.is_dir():  # checked before the server starts; os.replace could not put a file there
        sys.exit(f"playground_screenshot.py: --out: {str(out)!r} is a directory; give the PNG's file name")
    if out.exists() and not args.overwrite:
        sys.exit(f"playground_screenshot.py: --out: {str(out)!r} exists; pass --overwrite to replace it")
    chromium = shutil.which(args.chromium)  # checked before the server starts, as --out is
    if chromium is None:
        sys.exit(f"playground_screenshot.py: --chromium: {args.chromium!r} is not an executable file; install "
                 "Debian's chromium or pass --chromium PATH")
    from playwright.sync_api import sync_playwright

    port = free_port()
    try:
        server, url = start_server(["--checkpoint", args.checkpoint, "--quiet"], port)
    except RuntimeError as e:
        sys.exit(f"playground_screenshot.py: {e}")
    try:
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 960, "height": 720}, device_scale_factor=1)
            page.goto(url + "/")
            page.fill("#prompt", args.prompt)
            page.fill("#seed", args.seed)
            page.click("#generate")
            page.wait_for_function("document.getElementById('stats').textContent.includes('finished')"
                                   " || document.getElementById('error').textContent !== ''", timeout=120_000)
            if page.text_content("#error"):
                sys.exit(f"playground_screenshot.py: the page shows an error: {page.text_content('#error')}")
            try:
                save_screenshot(page, out)
            except OSError as e:
                sys.exit(f"playground_screenshot.py: --out: cannot write {str(out)!r}: {e.strerror or e}")
            browser.close()
    finally:
        server.terminate()
        server.wait(30)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

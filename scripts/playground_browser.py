"""Drive the /playground page in headless Chromium (Debian's /usr/bin/chromium through Playwright; never
Playwright's own browser download). The browser test (tests/test_playground.py) and the README's screenshot
(docs/playground.png) both come from here:

    redraft serve &                       # the bundled demo model, http://127.0.0.1:30000
    python scripts/playground_browser.py --url http://127.0.0.1:30000 --out docs/playground.png \
        --prompt "Tell me about the cat."   # the page's default prompt: S done in 3 forwards, Q still drafting
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

CHROMIUM = "/usr/bin/chromium"
PROMPT = "Count from 310 to 345."  # three blocks; the page's own default prompt is a shorter one (DEFAULT_PROMPT)
VIEWPORT = {"width": 1280, "height": 760}

# What the page keeps of each column (window.playground: the frames it drew, its counts, its final text).
COLUMNS_JS = """() => window.playground.columns.map((c) => ({
  title: c.title, frames: c.frames, finalText: c.finalText, error: c.error, done: c.done,
  framesWithMasks: c.framesWithMasks, tokenCounts: c.tokenCounts,
  counts: Object.fromEntries(["forwards", "tokens", "tpf", "edits"].map(
    (k) => [k, c.node.querySelector("." + k).textContent])),
}))"""


# Mid-animation: every column has drawn n frames and shows an edit, or drafts beside masks, now (or has ended).
SHOT_READY_JS = """(n) => window.playground.columns.length && window.playground.columns.every((c) => c.done || c.error
  || (c.frames.length >= n && (c.node.querySelector('.window .cell.edited')
      || (c.node.querySelector('.window .cell.mask')
          && c.node.querySelectorAll('.window .cell.drafted').length >= 2))))"""


def run_playground(url: str, *, race: bool, prompt: str = PROMPT, mode: str = "S", speed: str = "0",
                   api_key: str | None = None,
                   screenshot: Path | None = None, shot_after_frames: int = 3, timeout_s: float = 60.0) -> dict:
    """Open the page, type the prompt (and the key), pick the mode, press Run (or "S vs Q"), wait until it is
    done. Returns the
    columns the page drew and every console error it logged. `screenshot`: a PNG taken once every column has
    drawn `shot_after_frames` frames (mid-animation: masks and drafts show), else at the end."""
    from playwright.sync_api import sync_playwright  # the dev extra

    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport=VIEWPORT, device_scale_factor=1)
            page.set_default_timeout(timeout_s * 1000)
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{url}/playground")
            page.wait_for_function("window.playground && window.playground.ready")
            if api_key is not None:
                page.fill("#api-key", api_key)
                page.dispatch_event("#api-key", "change")
            page.fill("#prompt", prompt)
            page.select_option("#speed", speed)
            page.select_option("#mode", mode)
            page.click("#race" if race else "#run")
            if screenshot is not None and shot_after_frames:
                page.wait_for_function(SHOT_READY_JS, arg=shot_after_frames)
                page.screenshot(path=str(screenshot))
            page.wait_for_function("() => !window.playground.running && window.playground.columns.length"
                                   " && window.playground.columns.every((c) => c.done || c.error)")
            if screenshot is not None and not shot_after_frames:
                page.screenshot(path=str(screenshot))
            columns = page.evaluate(COLUMNS_JS)
            status = page.text_content("#status")
        finally:
            browser.close()
    return {"columns": columns, "console_errors": errors, "status": status}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    ap.add_argument("--out", type=Path, default=Path("docs/playground.png"), help="the screenshot (default: %(default)s)")
    ap.add_argument("--prompt", default=PROMPT, help="what to race S and Q on (default: %(default)s)")
    ap.add_argument("--api-key", default=None, help="the server's key, if it has one")
    args = ap.parse_args()
    got = run_playground(args.url, race=True, prompt=args.prompt, speed="400", api_key=args.api_key,
                         screenshot=args.out)
    print(json.dumps({"status": got["status"], "console_errors": got["console_errors"],
                      "counts": {c["title"]: c["counts"] for c in got["columns"]}}, indent=1))


if __name__ == "__main__":
    main()

"""Make docs/ui.png: the web page mid-conversation, in Debian's chromium through Playwright.

    python docs/screenshot.py                        # the tiny vision pair (replies are noise)
    python docs/screenshot.py --model G.gguf --chat-template gemma --ctx-size 1024

It starts `slotwise serve --http-port` on the model, chats through the page (with an image when
there is a projector) until a context shift has happened, and writes the screenshot.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
TURNS = [
    "I am planning a walk along the old harbour. What should I look out for?",
    "Which of those is best early in the morning?",
    "And if it rains, what would you do instead?",
    "Write me a short packing list as bullet points.",
    "Thanks! One more idea for the evening?",
    "Summarise the plan in two sentences.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", type=Path, help="a GGUF (default: the tiny vision pair)")
    p.add_argument("--mmproj", type=Path, help="its projector, for an image turn")
    p.add_argument("--chat-template", help="e.g. gemma")
    p.add_argument("--ctx-size", type=int, default=512, help="KV cells in all (two slots)")
    p.add_argument("--max-tokens", type=int, default=64, help="per reply")
    p.add_argument("--out", type=Path, default=HERE / "ui.png")
    args = p.parse_args()
    from playwright.sync_api import sync_playwright

    chromium = shutil.which("chromium") or sys.exit("needs Debian's chromium")
    with tempfile.TemporaryDirectory() as tmp:
        model, mmproj = args.model, args.mmproj
        if model is None:
            from slotwise_core.tiny_models import write_tiny_models

            pair = write_tiny_models(Path(tmp))["mrope"]
            model, mmproj = pair.model, pair.mmproj
        port = _free_port()
        argv = [sys.executable, "-m", "slotwise_cli", "serve", "--model", str(model),
                "--ctx-size", str(args.ctx_size), "--parallel", "2", "--http-port", str(port),
                "--prep-port", "0", "--infer-port", "0"]  # fmt: skip
        if mmproj is not None:
            argv += ["--mmproj", str(mmproj)]
        if args.chat_template:
            argv += ["--chat-template", args.chat_template]
        server = subprocess.Popen(argv)
        url = f"http://127.0.0.1:{port}"
        try:
            _wait_ready(url)
            with sync_playwright() as pw:
                browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
                page = browser.new_page(viewport={"width": 1360, "height": 860})
                page.set_default_timeout(300_000)
                page.goto(url)
                page.wait_for_selector('.slot[data-slot="0"] .cells')
                page.fill("#max-tokens", str(args.max_tokens))
                page.fill("#system", "You are a friendly local guide. Answer briefly.")
                photo = Path(tmp) / "harbour.png"
                if mmproj is not None:
                    _photo(photo)
                for i, text in enumerate(TURNS):
                    _send(page, text, photo if i == 0 and mmproj is not None else None)
                    if page.locator(".shifts li").count():
                        break
                # the KV picture shows the finished turn once its slot is idle again
                page.wait_for_function(
                    "[...document.querySelectorAll('.slot-head')]"
                    ".some(h => h.textContent.includes('idle'))"
                )
                page.screenshot(path=str(args.out))
                browser.close()
        finally:
            server.terminate()
            server.wait(60)
    print(f"wrote {args.out}")


def _send(page: Any, text: str, image: Path | None) -> None:
    n = page.locator(".message.assistant .usage").count()
    page.fill("#input", text)
    if image is not None:
        page.set_input_files("#file", str(image))
    page.click("#send")
    page.wait_for_function(f"document.querySelectorAll('.message.assistant .usage').length > {n}")


def _photo(path: Path) -> None:
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (320, 240), (120, 170, 220))
    d = ImageDraw.Draw(im)
    d.rectangle((0, 150, 320, 240), fill=(40, 90, 140))
    d.polygon([(60, 150), (120, 150), (100, 110), (70, 110)], fill=(200, 60, 50))
    d.ellipse((240, 20, 290, 70), fill=(250, 220, 90))
    im.save(path)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_ready(url: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"slotwise serve did not get ready at {url}")


if __name__ == "__main__":
    main()
